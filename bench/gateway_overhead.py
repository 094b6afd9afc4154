"""Gateway overhead: a fake OpenAI-compatible upstream measured directly, through Sparkgate
(``SPARKGATE_BACKEND=openai``) and through the LiteLLM proxy, at several concurrencies.

The upstream (a subprocess of this script, raw asyncio + ``httptools``, so it costs little
CPU itself) streams ``--chunks`` content chunks (default 128) ``--interval-ms`` apart (default
5), the first one at once, for ``POST /v1/chat/completions`` (what the client and LiteLLM call:
a role chunk, the content chunks, the last with ``finish_reason``, a usage chunk when asked,
``[DONE]``) and ``POST /v1/completions`` (what Sparkgate calls, the same chunks as
``text_completion`` objects). Chunk i's text is ``"x<i:03d> "``, so the client can count
content chunks whatever JSON the gateway writes.

The client (this process, raw asyncio + ``httptools``, one keep-alive connection per worker)
runs closed loops: ``c`` workers each send ``--requests`` streamed chat requests one after the
other (``c = 1``: ``--requests-c1``). Per level it records each request's TTFT (time from
sending the request to the first content chunk), the content chunks received (all must arrive)
and the level's wall time. Definitions:

* **TTFT added at c = 1** = median TTFT through the gateway − median TTFT direct;
* **aggregate chunks/s** = content chunks received / wall time of the level; its ratio to
  direct's at the same c;
* **gateway CPU per chunk** = CPU time (user + system, ``/proc/<pid>/stat``, the gateway's
  whole process tree) spent during the level / content chunks received.

Each figure is the median over ``--repeats`` rounds (≥ 3); the three targets run interleaved
within a round (direct, Sparkgate, LiteLLM at each c) so machine noise hits them alike; min
and max are printed beside each median. Every gateway runs as ONE worker process. Sparkgate
runs with a fresh SQLite database, one API key (auth, admission, request records and
metrics all on), the upstream backend's defaults and the served model's tokenizer (the
converted embedded model); LiteLLM with a master key, no database.

LiteLLM (PyPI ``litellm[proxy]``, pinned in the ``bench`` extra of pyproject.toml) does not
install into the project's environment without changing versions the project resolves
(``huggingface_hub``, ``cryptography``, ``rich``…), so with ``--install-litellm`` this script
creates its own virtual environment under ``$SPARKGATE_CACHE_DIR/bench/litellm-venv`` and
installs the pinned version there; without it, an existing one is used, else LiteLLM is
skipped (said so in the JSON).

Usage:
    .venv/bin/python bench/gateway_overhead.py --install-litellm
    .venv/bin/python bench/gateway_overhead.py --repeats 5 --concurrency 1 16 64 --no-litellm
    git worktree add /tmp/sparkgate-old <commit> && \\
        .venv/bin/python bench/gateway_overhead.py --no-litellm --compare-root /tmp/sparkgate-old
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LITELLM_PIN = "litellm[proxy]==1.108.7"  # keep equal to the ``bench`` extra in pyproject.toml
MODEL = "bench-model"
MARKER = re.compile(rb"x(\d{3}) ")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the fake upstream (runs as a subprocess: --serve-upstream PORT) ------------------------------

def upstream_chunks(n: int) -> dict[str, tuple[bytes, list[bytes], bytes, bytes]]:
    """Per endpoint: (first event, the n content events, the usage event, [DONE]), pre-encoded."""
    def ev(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
    chat_head = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    chat = [ev({**chat_head, "choices": [{"index": 0, "delta": {"content": f"x{i:03d} "}, "logprobs": None,
                                           "finish_reason": "length" if i == n - 1 else None}]}) for i in range(n)]
    text_head = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": MODEL}
    text = [ev({**text_head, "choices": [{"index": 0, "text": f"x{i:03d} ", "logprobs": None,
                                           "finish_reason": "length" if i == n - 1 else None}]}) for i in range(n)]
    done = b"data: [DONE]\n\n"
    return {
        "/v1/chat/completions": (ev({**chat_head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                                "logprobs": None, "finish_reason": None}]}),
                                 chat, ev({**chat_head, "choices": [], "usage": usage}), done),
        "/v1/completions": (b"", text, ev({**text_head, "choices": [], "usage": usage}), done),
    }


class UpstreamProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the fake upstream (requests are not pipelined)."""

    def __init__(self, chunks: dict, interval_s: float) -> None:
        import httptools

        self.chunks, self.interval_s = chunks, interval_s
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.body, self.closed = b"", [], False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:  # noqa: BLE001 — a bad request: drop the connection
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path, body = self.url.split(b"?")[0].decode(), b"".join(self.body)
        self.url, self.body = b"", []
        if path in self.chunks:
            asyncio.get_running_loop().create_task(self.stream(path, body))
        else:
            payload = b'{"object":"list","data":[{"id":"bench-model","object":"model"}]}'
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    async def stream(self, path: str, body: bytes) -> None:
        first, content, usage, done = self.chunks[path]
        include_usage = b'"include_usage":true' in body.replace(b" ", b"")
        write = self.transport.write

        def chunk(data: bytes) -> None:
            write(b"%x\r\n%b\r\n" % (len(data), data))

        write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
              b"transfer-encoding: chunked\r\n\r\n")
        if first:
            chunk(first)
        for i, data in enumerate(content):
            if i:
                await asyncio.sleep(self.interval_s)
            if self.closed:
                return
            chunk(data)
        if include_usage:
            chunk(usage)
        chunk(done)
        write(b"0\r\n\r\n")


def serve_upstream(port: int, n: int, interval_s: float) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    chunks = upstream_chunks(n)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: UpstreamProtocol(chunks, interval_s),
                                                                "127.0.0.1", port, backlog=1024)
        print("ready", flush=True)
        await server.serve_forever()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


# -- the client -----------------------------------------------------------------------------------

class Client:
    """One keep-alive connection sending streamed chat requests one after the other."""

    def __init__(self, host: str, port: int, path: str, headers: dict[str, str], body: bytes) -> None:
        self.host, self.port = host, port
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.request = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                        f"accept: text/event-stream\r\n{head}content-length: {len(body)}\r\n\r\n").encode() + body
        self.reader = self.writer = None

    async def one(self) -> tuple[float | None, int, int]:
        """Send one request; returns (TTFT s, content chunks, HTTP status)."""
        import httptools

        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        state = {"buf": b"", "chunks": 0, "first": None, "done": False, "status": 0}
        t0 = time.perf_counter()

        class Callbacks:
            def on_body(_, data: bytes) -> None:
                buf = state["buf"] + data
                events = buf.split(b"\n\n")
                state["buf"] = events.pop()
                for e in events:
                    if MARKER.search(e):
                        if state["first"] is None:
                            state["first"] = time.perf_counter() - t0
                        state["chunks"] += 1

            def on_message_complete(_) -> None:
                state["done"] = True

        parser = httptools.HttpResponseParser(Callbacks())
        self.writer.write(self.request)
        while not state["done"]:
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError("the server closed the connection mid-response")
            parser.feed_data(data)
        state["status"] = parser.get_status_code()
        if not parser.should_keep_alive():
            self.writer.close()
            self.writer = None
        return state["first"], state["chunks"], state["status"]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run_level(target: dict, concurrency: int, requests: int, expect: int) -> dict:
    """``concurrency`` closed-loop workers × ``requests`` each; TTFTs, chunks, wall, CPU."""
    clients = [Client("127.0.0.1", target["port"], "/v1/chat/completions", target["headers"], target["body"])
               for _ in range(concurrency)]
    ttfts: list[float] = []
    chunks = 0

    async def worker(client: Client) -> None:
        nonlocal chunks
        for _ in range(requests):
            ttft, n, status = await client.one()
            if status != 200 or n != expect:
                raise RuntimeError(f"{target['name']}: HTTP {status}, {n} of {expect} chunks")
            ttfts.append(ttft)
            chunks += n

    cpu0 = tree_cpu_s(target["pid"])
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in clients))
    finally:
        for c in clients:
            c.close()
    wall = time.perf_counter() - t0
    cpu = tree_cpu_s(target["pid"]) - cpu0 if target["pid"] else None
    return {"ttft_ms": statistics.median(ttfts) * 1e3, "chunks_per_s": chunks / wall, "chunks": chunks,
            "wall_s": wall, "cpu_ms_per_chunk": None if cpu is None else cpu * 1e3 / chunks}


def tree_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` and its descendants (Linux ``/proc``)."""
    if not pid:
        return 0.0
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        todo.extend(children.get(p, []))
    return total


# -- the gateways ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, what: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what} not ready within {timeout_s} s")


def start_upstream(n: int, interval_s: float) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(port), "--chunks", str(n),
                             "--interval-ms", str(interval_s * 1e3)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the fake upstream did not start")
    return proc, port


def start_sparkgate(upstream_port: int, tmp: Path, root: Path = ROOT) -> tuple[subprocess.Popen, int, str]:
    """Sparkgate from the checkout ``root`` (this one by default) with a fresh database in ``tmp``."""
    port = free_port()
    env = {**os.environ, "SPARKGATE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/sparkgate.db",
           "SPARKGATE_BACKEND": "openai", "SPARKGATE_UPSTREAM_URLS": f"http://127.0.0.1:{upstream_port}",
           "SPARKGATE_MODEL_NAME": MODEL, "PYTHONPATH": str(root)}
    py = sys.executable
    subprocess.run([py, "-m", "gateway.cli", "db", "upgrade"], env=env, check=True, cwd=root, capture_output=True)
    out = subprocess.run([py, "-m", "gateway.cli", "keys", "create", "--tenant", "bench"], env=env, check=True,
                         cwd=root, capture_output=True, text=True).stdout
    key = next(w for w in out.split() if w.startswith("sk-"))
    proc = subprocess.Popen([py, "-m", "uvicorn", "gateway.main:create_app", "--factory", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning", "--workers", "1"], env=env, cwd=root)
    wait_ready(proc, f"http://127.0.0.1:{port}/readyz", "Sparkgate")
    return proc, port, key


def litellm_venv() -> Path:
    base = Path(os.environ.get("SPARKGATE_CACHE_DIR", "~/.cache/sparkgate")).expanduser()
    return base / "bench" / "litellm-venv"


def install_litellm() -> Path:
    """The LiteLLM venv (module docstring), created and filled with :data:`LITELLM_PIN` if missing."""
    venv = litellm_venv()
    exe = venv / "bin" / "litellm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LITELLM_PIN], check=True)
    return exe


def start_litellm(exe: Path, upstream_port: int, tmp: Path) -> tuple[subprocess.Popen, int, str]:
    port, key = free_port(), "sk-litellm-bench"
    config = tmp / "litellm.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{upstream_port}/v1", "api_key": "sk-fake"}}],
        "general_settings": {"master_key": key},
        "litellm_settings": {"telemetry": False, "drop_params": True},
    }))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "True"}
    env.pop("DATABASE_URL", None)
    proc = subprocess.Popen([str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "litellm.log", "w"))
    wait_ready(proc, f"http://127.0.0.1:{port}/health/liveliness", "LiteLLM")
    return proc, port, key


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- main -----------------------------------------------------------------------------------------

def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version()}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(rows: list[dict], targets: list[str], levels: list[int]) -> dict:
    out: dict = {"targets": {}}
    for name in targets:
        out["targets"][name] = {}
        for c in levels:
            rs = [r for r in rows if r["target"] == name and r["c"] == c]
            cell = {k: spread([r[k] for r in rs]) for k in ("ttft_ms", "chunks_per_s")}
            if rs and rs[0]["cpu_ms_per_chunk"] is not None:
                cell["cpu_ms_per_chunk"] = spread([r["cpu_ms_per_chunk"] for r in rs])
            out["targets"][name][str(c)] = cell
    direct = out["targets"]["direct"]
    for name in targets[1:]:
        s = out["targets"][name]
        out[name] = {
            "added_ttft_ms_c1": s["1"]["ttft_ms"]["median"] - direct["1"]["ttft_ms"]["median"] if "1" in s else None,
            "throughput_vs_direct": {c: s[c]["chunks_per_s"]["median"] / direct[c]["chunks_per_s"]["median"]
                                     for c in s},
            "cpu_ms_per_chunk": {c: s[c]["cpu_ms_per_chunk"]["median"] for c in s},
        }
    return out


async def measure(targets: list[dict], levels: list[int], repeats: int, requests: int, requests_c1: int,
                  expect: int) -> list[dict]:
    for t in targets:  # warm-up: connections, imports, the first records
        await run_level(t, 4, 2, expect)
    rows = []
    for r in range(repeats):
        for c in levels:
            for t in targets:
                res = await run_level(t, c, requests_c1 if c == 1 else requests, expect)
                rows.append({"target": t["name"], "c": c, "round": r, **res})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3, help="requests per worker at c > 1")
    ap.add_argument("--requests-c1", type=int, default=10, help="requests at c = 1")
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--install-litellm", action="store_true", help=f"create the LiteLLM venv ({LITELLM_PIN})")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--compare-root", type=Path, default=None,
                    help="also run Sparkgate from this other checkout (target 'sparkgate-compare'), e.g. an older "
                         "commit's `git worktree`, to measure a change on the same machine in the same run")
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.chunks, args.interval_ms / 1e3)
        return
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="sparkgate-overhead-"))
    procs: list[subprocess.Popen] = []
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2 * args.chunks,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    notes = []
    try:
        up, up_port = start_upstream(args.chunks, args.interval_ms / 1e3)
        procs.append(up)
        targets = [{"name": "direct", "port": up_port, "pid": None, "headers": {}, "body": body}]
        sg, sg_port, sg_key = start_sparkgate(up_port, tmp)
        procs.append(sg)
        targets.append({"name": "sparkgate", "port": sg_port, "pid": sg.pid,
                        "headers": {"authorization": f"Bearer {sg_key}"}, "body": body})
        if args.compare_root is not None:
            cmp_tmp = tmp / "compare"
            cmp_tmp.mkdir()
            cp, cp_port, cp_key = start_sparkgate(up_port, cmp_tmp, args.compare_root.resolve())
            procs.append(cp)
            targets.append({"name": "sparkgate-compare", "port": cp_port, "pid": cp.pid, "version": str(args.compare_root),
                            "headers": {"authorization": f"Bearer {cp_key}"}, "body": body})
        exe = None
        if not args.no_litellm:
            exe = install_litellm() if args.install_litellm else litellm_venv() / "bin" / "litellm"
            if not exe.exists():
                notes.append(f"LiteLLM skipped: no venv at {litellm_venv()} (run with --install-litellm)")
                exe = None
        if exe is not None:
            ll, ll_port, ll_key = start_litellm(exe, up_port, tmp)
            procs.append(ll)
            version = subprocess.run([str(exe.parent / "python"), "-c", "import importlib.metadata as m; "
                                      "print(m.version('litellm'))"], capture_output=True, text=True).stdout.strip()
            targets.append({"name": "litellm", "port": ll_port, "pid": ll.pid, "version": version,
                            "headers": {"authorization": f"Bearer {ll_key}"}, "body": body})
        before = machine()
        rows = asyncio.run(measure(targets, args.concurrency, args.repeats, args.requests, args.requests_c1,
                                   args.chunks))
        result = {
            "machine": before, "loadavg_after": os.getloadavg(),
            "params": {"chunks": args.chunks, "interval_ms": args.interval_ms, "concurrency": args.concurrency,
                       "repeats": args.repeats, "requests_per_worker": args.requests, "requests_c1": args.requests_c1},
            "versions": {t["name"]: t.get("version") for t in targets if t.get("version")},
            "notes": notes,
            **summarize(rows, [t["name"] for t in targets], args.concurrency),
            "rows": rows,
        }
        print(json.dumps(result, indent=1))
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""``bench/gateway_overhead.py``'s own machinery, so the bench cannot rot unnoticed: its fake
upstream (a real subprocess) streams the chunks it promises to its raw HTTP client, on both
endpoints, with keep-alive; the summary computes the ratios the docs quote."""

from __future__ import annotations

import asyncio
import json

from tests.support.hardening_util import load_bench

go = load_bench("gateway_overhead")


def test_fake_upstream_and_client_count_every_chunk():
    proc, port = go.start_upstream(5, 0.001)
    try:
        body = json.dumps({"stream": True, "stream_options": {"include_usage": True}}).encode()
        target = {"name": "direct", "port": port, "pid": proc.pid, "headers": {}, "body": body}
        level = asyncio.run(go.run_level(target, 3, 2, expect=5))
        assert level["chunks"] == 30 and level["cpu_ms_per_chunk"] is not None
        assert 0 < level["ttft_ms"] < level["wall_s"] * 1e3

        async def text_stream() -> tuple:
            client = go.Client("127.0.0.1", port, "/v1/completions", {}, b'{"prompt": [1, 2]}')
            try:  # two requests on one connection: the keep-alive the gateways rely on
                return await client.one(), await client.one()
            finally:
                client.close()

        first, second = asyncio.run(text_stream())
        assert first[1:] == second[1:] == (5, 200)
    finally:
        go.stop(proc)


def test_upstream_chunks_carry_the_markers_the_client_counts():
    chat_first, chat, chat_usage, done = go.upstream_chunks(3)["/v1/chat/completions"]
    assert [go.MARKER.search(c).group(1) for c in chat] == [b"000", b"001", b"002"]
    assert go.MARKER.search(chat_first) is None and go.MARKER.search(chat_usage) is None and done == b"data: [DONE]\n\n"
    assert json.loads(chat[-1][6:])["choices"][0]["finish_reason"] == "length"
    _, text, _, _ = go.upstream_chunks(3)["/v1/completions"]
    assert json.loads(text[1][6:])["choices"][0]["text"] == "x001 "


def test_summary_ratios_and_added_ttft():
    rows = [{"target": t, "c": c, "round": r, "ttft_ms": ttft, "chunks_per_s": cps, "cpu_ms_per_chunk": cpu}
            for r in range(3)
            for t, c, ttft, cps, cpu in [("direct", 1, 0.2 + r / 100, 190.0, None), ("direct", 16, 1.0, 3000.0, None),
                                         ("gw", 1, 3.2 + r / 100, 180.0, 0.5), ("gw", 16, 20.0, 2400.0 + r, 0.2)]]
    out = go.summarize(rows, ["direct", "gw"], [1, 16])
    assert round(out["gw"]["added_ttft_ms_c1"], 6) == 3.0
    assert out["gw"]["throughput_vs_direct"] == {"1": 180 / 190, "16": 2401 / 3000}
    assert out["gw"]["cpu_ms_per_chunk"] == {"1": 0.5, "16": 0.2}
    assert out["targets"]["gw"]["16"]["chunks_per_s"] == {"median": 2401.0, "min": 2400.0, "max": 2402.0, "n": 3}

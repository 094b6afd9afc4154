"""OpenAI ``logprobs`` on /v1/chat/completions and /v1/completions: shapes, streaming
vs non-streaming, token bytes (multibyte characters), the 400s — on the fake backend —
and stream == non-stream at T=0 on the real engine (in-process)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.openai.logprobs import LogprobsBuilder
from gateway.main import create_app
from runtime.interface import BackendInfo, TokenLogprob
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import MODEL, chat, parse_sse, real_app

CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"
ENTRY_KEYS = {"token", "logprob", "bytes", "top_logprobs"}


def assert_chat_entry(e: dict, n_top: int) -> None:
    assert set(e) == ENTRY_KEYS and isinstance(e["logprob"], float) and e["logprob"] <= 0
    assert bytes(e["bytes"]).decode() == e["token"]  # every fake/complete token is valid UTF-8
    assert len(e["top_logprobs"]) == n_top
    for alt in e["top_logprobs"]:
        assert set(alt) == {"token", "logprob", "bytes"} and bytes(alt["bytes"]).decode() == alt["token"]
    vals = [a["logprob"] for a in e["top_logprobs"]]
    assert vals == sorted(vals, reverse=True)


def stream_chunks(text: str) -> list[dict]:
    events = parse_sse(text)
    assert events[-1] == "[DONE]"
    return events[:-1]


# ------------------------------------------------------------------ chat, fake backend

@pytest.mark.parametrize("tokens_per_delta", [1, 3])
async def test_chat_logprobs_non_stream_and_stream_agree(client, auth, backend, tokens_per_delta):
    backend.tokens_per_delta = tokens_per_delta
    body = chat(logprobs=True, top_logprobs=3, temperature=0)
    r = await client.post(CHAT, json=body, headers=auth)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert set(choice["logprobs"]) == {"content", "refusal"} and choice["logprobs"]["refusal"] is None
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] == len(backend.script)
    for j, e in enumerate(content):
        assert_chat_entry(e, 3)
        assert e["logprob"] == backend.fake_logprob(j, 3).logprob  # values pass through unchanged
        assert e["top_logprobs"][0]["token"] == e["token"]  # the fake's token is its own top-1
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    assert backend.requests[-1].sampling.logprobs == 3
    sdk = ChatCompletion.model_validate(r.json()).choices[0].logprobs  # the OpenAI SDK's own types
    assert sdk.content[1].top_logprobs[2].bytes == content[1]["top_logprobs"][2]["bytes"]

    s = await client.post(CHAT, json={**body, "stream": True}, headers=auth)
    chunks = stream_chunks(s.text)
    role, contents, final = chunks[0], chunks[1:-1], chunks[-1]
    assert all(ChatCompletionChunk.model_validate(c) for c in chunks)
    assert role["choices"][0]["logprobs"] is None and final["choices"][0]["logprobs"] is None
    streamed = []
    for c in contents:
        ch = c["choices"][0]
        streamed += ch["logprobs"]["content"]
        # the rule: a chunk lists exactly the tokens whose text it carries (fake: no held-back text)
        assert "".join(e["token"] for e in ch["logprobs"]["content"]) == ch["delta"]["content"]
        assert len(ch["logprobs"]["content"]) <= tokens_per_delta
    assert streamed == content


async def test_chat_logprobs_without_top_logprobs_and_off(client, auth, backend):
    r = await client.post(CHAT, json=chat(logprobs=True), headers=auth)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(e["top_logprobs"] == [] for e in content)
    assert backend.requests[-1].sampling.logprobs == 0
    for off in ({}, {"logprobs": False}, {"logprobs": None}):
        r = await client.post(CHAT, json=chat(**off), headers=auth)
        assert r.json()["choices"][0]["logprobs"] is None and backend.requests[-1].sampling.logprobs is None
        s = await client.post(CHAT, json=chat(stream=True, **off), headers=auth)
        assert all(c["choices"][0]["logprobs"] is None for c in stream_chunks(s.text))


@pytest.mark.parametrize("extra,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": "true"}, "logprobs"),
])
async def test_chat_logprobs_400s(client, auth, backend, extra, param):
    for stream in (False, True):
        r = await client.post(CHAT, json=chat(stream=stream, **extra), headers=auth)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]
    assert backend.requests == []


# ------------------------------------------------------------------ legacy completions, fake backend

async def test_completion_logprobs_shape_and_stream(client, auth, backend):
    body = {"model": MODEL, "prompt": "Once upon a time", "logprobs": 2, "max_tokens": 5}
    r = await client.post(LEGACY, json=body, headers=auth)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert "".join(lp["tokens"]) == choice["text"] == "Hello there, I am a"
    assert lp["text_offset"] == [choice["text"].index(t) if i == 0 else sum(map(len, lp["tokens"][:i]))
                                 for i, t in enumerate(lp["tokens"])] == [0, 5, 12, 14, 17]
    assert Completion.model_validate(r.json()).choices[0].logprobs.text_offset == lp["text_offset"]
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == val and len(top) == 2  # chosen token is among the 2 (fake: it is top-1)
    assert backend.requests[-1].sampling.logprobs == 2

    s = await client.post(LEGACY, json={**body, "stream": True}, headers=auth)
    merged = {k: [] for k in lp}
    for c in stream_chunks(s.text):
        if c["choices"] and c["choices"][0]["logprobs"] is not None:
            for k in merged:
                merged[k] += c["choices"][0]["logprobs"][k]
    assert merged == lp  # text_offset continues across chunks


async def test_completion_logprobs_zero_gives_the_chosen_token(client, auth):
    r = await client.post(LEGACY, json={"model": MODEL, "prompt": "hi", "logprobs": 0, "max_tokens": 2}, headers=auth)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


@pytest.mark.parametrize("value", [6, -1, True, 1.5, "2"])
async def test_completion_logprobs_400(client, auth, backend, value):
    r = await client.post(LEGACY, json={"model": MODEL, "prompt": "hi", "logprobs": value}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert backend.requests == []


@dataclass
class NoLogprobsBackend(FakeBackend):
    """A backend that cannot return logprobs (like the SGLang client)."""

    @property
    def info(self) -> BackendInfo:
        return BackendInfo(self.model_name, self.max_context, 0, supports_logprobs=False)


async def test_backend_without_logprobs_answers_400(settings, auth):
    backend = NoLogprobsBackend()
    application = create_app(settings, backend)
    async with application.router.lifespan_context(application):
        await application.state.backend_start
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                     base_url="http://t") as c:
            for url, body in ((CHAT, chat(logprobs=True)), (LEGACY, {"model": MODEL, "prompt": "hi", "logprobs": 1})):
                r = await c.post(url, json=body, headers=auth)
                assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text
                assert r.json()["error"]["param"] == "logprobs"
            assert (await c.post(CHAT, json=chat(), headers=auth)).status_code == 200
    assert len(backend.requests) == 1


# ------------------------------------------------------------------ bytes of multibyte characters

def test_builder_splits_multibyte_characters_into_bytes():
    """'é' (2 bytes) and '😀' (4 bytes) each split over two tokens, as byte-level BPE does."""
    pieces = {1: b"h", 2: b"\xc3", 3: b"\xa9!", 4: b" \xf0\x9f", 5: b"\x98\x80", 6: b"<|im_end|>"}
    text = "hé! 😀"
    b = LogprobsBuilder(lambda ids: [pieces[i] for i in ids], 1)
    entries = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in (1, 2, 3, 4, 5, 6)]
    content = b.chat(entries)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content[:-1]).decode() == text
    assert [e["token"] for e in content] == ["h", "\\xc3", "\\xa9!", " \\xf0\\x9f", "\\x98\\x80", "<|im_end|>"]
    assert content[1]["top_logprobs"][0]["bytes"] == [0xC3]
    # legacy offsets count characters of the text; a token inside a character gets its start
    legacy = [LogprobsBuilder(lambda ids: [pieces[i] for i in ids], 0) for _ in range(2)]
    whole = legacy[0].completion(entries)["text_offset"]
    chunked = legacy[1].completion(entries[:2])["text_offset"] + legacy[1].completion(entries[2:])["text_offset"]
    assert whole == chunked == [0, 1, 1, 3, 4, 5]  # EOS: at the end of the text
    assert text[whole[3]:] == " 😀" and text[whole[1]] == "é"


@pytest.mark.model
def test_real_tokenizer_token_bytes(tokenizer):
    """SmolLM2's byte-level BPE: joined bytes are the exact UTF-8 of the text, a split
    character's tokens are not valid UTF-8 alone, and whole tokens match decode()."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from runtime.engine.detokenizer import _BYTE_DECODER, token_bytes

    assert _BYTE_DECODER == {c: b for b, c in bytes_to_unicode().items()}
    text = "Naïve café — 😀 日本語!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    raw = token_bytes(tokenizer, ids)
    assert b"".join(raw) == text.encode()
    broken = [r for r in raw if _invalid(r)]
    assert broken, "expected at least one token holding part of a character"
    for tid, r in zip(ids, raw):
        if not _invalid(r):
            assert r.decode() == tokenizer.decode([tid])
    assert token_bytes(tokenizer, [2, tokenizer.eos_token_id]) == [b"<|im_end|>"] * 2


def _invalid(raw: bytes) -> bool:
    try:
        raw.decode()
        return False
    except UnicodeDecodeError:
        return True


# ------------------------------------------------------------------ the real engine, in-process

TOL = 1e-4  # the second request reuses the first one's prompt KV (prefix cache): other shapes, ~1e-6 apart


def assert_close_chat(got: list[dict], want: list[dict]) -> None:
    """Same tokens, bytes and alternatives; logprobs equal up to fp32 noise."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a["token"], a["bytes"]) == (b["token"], b["bytes"]) and abs(a["logprob"] - b["logprob"]) <= TOL
        assert [(x["token"], x["bytes"]) for x in a["top_logprobs"]] == [(x["token"], x["bytes"]) for x in b["top_logprobs"]]
        assert all(abs(x["logprob"] - y["logprob"]) <= TOL for x, y in zip(a["top_logprobs"], b["top_logprobs"]))


@pytest.mark.model
async def test_real_engine_stream_equals_non_stream_at_t0(settings, auth, target_fp32, tokenizer):
    body = chat("What is the capital of France?", temperature=0, max_tokens=24, logprobs=True, top_logprobs=4)
    legacy = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 12,
              "logprobs": 3}
    async with real_app(settings, target_fp32, tokenizer, spec_method="prompt_lookup", spec_policy="fixed") as c:
        r = (await c.post(CHAT, json=body, headers=auth)).json()
        s = stream_chunks((await c.post(CHAT, json={**body, "stream": True}, headers=auth)).text)
        lr = (await c.post(LEGACY, json=legacy, headers=auth)).json()
        ls = stream_chunks((await c.post(LEGACY, json={**legacy, "stream": True}, headers=auth)).text)

    content, text = r["choices"][0]["logprobs"]["content"], r["choices"][0]["message"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] and "Paris" in text
    for e in content:
        assert set(e) == ENTRY_KEYS and len(e["top_logprobs"]) == 4
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the chosen token is the top-1
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]
    plain = [e for e in content if e["token"] != "<|im_end|>"]
    assert b"".join(bytes(e["bytes"]) for e in plain).decode() == text  # bytes add up to the content
    streamed = [e for c in s[1:-1] for e in c["choices"][0]["logprobs"]["content"]]
    assert_close_chat(streamed, content)
    assert "".join(c["choices"][0]["delta"]["content"] for c in s[1:-1]) == text

    lp = lr["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == lr["usage"]["completion_tokens"] == 12 and "".join(lp["tokens"]) == lr["choices"][0]["text"]
    merged = {k: [x for c in ls if c["choices"] and c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"][k]]
              for k in lp}
    assert {k: merged[k] for k in ("tokens", "text_offset")} == {k: lp[k] for k in ("tokens", "text_offset")}
    assert max(abs(a - b) for a, b in zip(merged["token_logprobs"], lp["token_logprobs"])) <= TOL
    for a, b in zip(merged["top_logprobs"], lp["top_logprobs"]):
        assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) <= TOL

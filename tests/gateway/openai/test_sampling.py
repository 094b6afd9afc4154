"""The sampling surface on the OpenAI routes: ``n`` independent choices (streamed and not,
usage, seeds, records, rate limits), penalties / ``logit_bias`` / vLLM extras passed to the
runtime, their 400s — against the FakeBackend — and, on the real engine in process,
``logit_bias`` forcing and banning a token, ``min_tokens`` holding EOS back,
``stop_token_ids`` ending a reply and seeded choices."""

from __future__ import annotations


import pytest

from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.gateway_fixtures import MODEL, chat, parse_sse, served_engine
from tests.support.tenancy_fixtures import ADMIN_HEADERS, bearer, new_key, running_app

URL = "/v1/chat/completions"
TEXT = "Hello there, I am a fake model."  # the FakeBackend's script
PROMPT = 6  # chat("hi") through the FakeBackend's template


# ------------------------------------------------------------------ n, FakeBackend


async def test_n_choices_non_streamed_usage_summed_seeds_derived(client, auth, backend):
    r = await client.post(URL, json=chat("hi", n=3, seed=7, max_tokens=4, temperature=0.5), headers=auth)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in data["choices"]} == {"Hello there, I am"}
    assert {c["finish_reason"] for c in data["choices"]} == {"length"}
    assert data["usage"] == {"prompt_tokens": PROMPT, "completion_tokens": 12, "total_tokens": PROMPT + 12}
    reqs = backend.requests[-3:]
    assert [q.request_id for q in reqs] == [data["id"], data["id"] + "-1", data["id"] + "-2"]
    assert [q.sampling.seed for q in reqs] == [7, 8, 9]
    assert {(q.sampling.temperature, q.sampling.max_tokens, tuple(q.prompt_token_ids)) for q in reqs} == {
        (0.5, 4, tuple(reqs[0].prompt_token_ids))}
    r = await client.post(URL, json=chat("hi", n=2, seed=2**64 - 1), headers=auth)  # seed + 1 wraps to 0
    assert r.status_code == 200 and [q.sampling.seed for q in backend.requests[-2:]] == [2**64 - 1, 0]
    r = await client.post(URL, json=chat("hi", n=2), headers=auth)
    assert [q.sampling.seed for q in backend.requests[-2:]] == [None, None]


async def test_n_choices_streamed_interleaved_with_one_usage_chunk(client, auth, backend):
    backend.token_delay_s = 0.005  # both choices decode at once
    r = await client.post(URL, json=chat("hi", n=2, stream=True, stream_options={"include_usage": True}),
                          headers=auth)
    assert r.status_code == 200
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert [c["choices"][0] for c in chunks[:2]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in (0, 1)]
    body, usage = chunks[2:-1], chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": PROMPT, "completion_tokens": 14,
                                                         "total_tokens": PROMPT + 14}
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in body)
    order = [c["choices"][0]["index"] for c in body if c["choices"][0]["delta"]]
    assert sorted(order) == [0] * 7 + [1] * 7 and order != sorted(order)  # interleaved as they came
    for i in (0, 1):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == TEXT
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
        assert mine[-1]["finish_reason"] == "stop" and mine[-1]["delta"] == {}


async def test_n_choices_carry_their_own_logprobs_and_spec_stats_sum(client, auth, backend):
    r = await client.post(URL, json=chat("hi", n=2, logprobs=True, top_logprobs=1, max_tokens=5,
                                         return_spec_stats=True), headers=auth)
    data = r.json()
    for c in data["choices"]:
        assert [e["token"] for e in c["logprobs"]["content"]] == ["Hello", " there,", " I", " am", " a"]
    # the fake's stats per choice: 2 rounds, 8 drafted and verified, 3 accepted, 5 emitted, [2, 1]
    assert data["spec_stats"] == {"rounds": 4, "drafted": 16, "verified": 16, "accepted": 6, "emitted": 10,
                                  "tau": 2.5, "accepted_per_position": [4, 2], "gated_rounds": 0}


async def test_n_on_legacy_completions(client, auth, backend):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi there", "n": 2, "max_tokens": 3,
                                                   "logprobs": 1}, headers=auth)
    data = r.json()
    assert [(c["index"], c["text"]) for c in data["choices"]] == [(0, "Hello there, I"), (1, "Hello there, I")]
    assert [c["logprobs"]["text_offset"] for c in data["choices"]] == [[0, 5, 12]] * 2  # offsets restart per choice
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


async def test_n_choices_with_tools_parse_each_reply_on_its_own(client, auth, backend):
    """Each choice has its own streaming tool-call parser: both streamed choices assemble the
    whole call (one parser shared by interleaved choices would mix them up)."""
    from tests.gateway.openai.test_tools import SCRIPT, WEATHER

    backend.max_context, backend.script, backend.token_delay_s = 4096, SCRIPT, 0.002
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "n": 2}
    whole = (await client.post(URL, json=body, headers=auth)).json()["choices"]
    assert [c["finish_reason"] for c in whole] == ["tool_calls"] * 2
    assert [c["message"]["tool_calls"][0]["function"]["arguments"] for c in whole] == ['{"city": "Paris"}'] * 2
    chunks = [e for e in parse_sse((await client.post(URL, json={**body, "stream": True}, headers=auth)).text)
              if e != "[DONE]"]
    for i in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(d.get("content", "") for d in deltas) == "I will check."
        args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
        assert args == '{"city": "Paris"}'
        assert [c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["index"] == i and c["choices"][0]["finish_reason"]] == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
async def test_n_engine_failure_is_a_500_or_an_error_event(client, auth, backend, stream):
    backend.fail_after_deltas = 2
    r = await client.post(URL, json=chat("hi", n=2, stream=stream), headers=auth)
    if not stream:
        assert_openai_error(r, 500, "server_error", None)
    else:
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]" and "error" in events[-2]
    backend.fail_after_deltas = 0  # before the first token: a real HTTP 500 also when streaming
    r = await client.post(URL, json=chat("hi", n=2, stream=stream), headers=auth)
    assert_openai_error(r, 500, "server_error", None)


@pytest.mark.parametrize("lazy", [False, True])
async def test_n_queue_full_503_and_nothing_left_running(client, auth, backend, lazy):
    backend.queue_full, backend.raise_lazily = True, lazy
    r = await client.post(URL, json=chat("hi", n=3, stream=True), headers=auth)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert backend._running == 0


async def test_n_is_one_record_billed_once_and_reserves_n_completions(sqlite_db):
    """One API request = one record (completion tokens summed, the prompt once) and one
    billing; tpm reserves prompt + n · max_tokens before anything runs."""
    async with running_app(sqlite_db) as (app, client):
        h = bearer(await new_key(client, "acme", "alice", tpm_limit=PROMPT + 10))
        over = await client.post(URL, json=chat("hi", n=3, max_tokens=5), headers=h)  # 6 + 15 > 16
        assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
        ok = await client.post(URL, json=chat("hi", n=2, max_tokens=5), headers=h)  # 6 + 10 ≤ 16
        assert ok.status_code == 200, ok.text
        rid = ok.json()["id"]
        await app.state.records.flush()
        rec = (await client.get(f"/v1/requests/{rid}", headers=h)).json()
        assert (rec["status"], rec["prompt_tokens"], rec["completion_tokens"], rec["finish_reason"]) == (
            "finished", PROMPT, 10, "length")
        listed = (await client.get("/v1/requests", headers=h)).json()["data"]
        assert sorted(r["id"] for r in listed if r["status"] == "finished") == [rid]  # not one per choice
        keys = (await client.get("/admin/v1/keys", params={"tenant": "acme"}, headers=ADMIN_HEADERS)).json()["data"]
        assert [k["tokens_used"] for k in keys] == [PROMPT + 10]


# ------------------------------------------------------------------ the other fields, FakeBackend


async def test_sampling_fields_reach_the_runtime(client, auth, backend):
    body = chat("hi", presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.1, min_p=0.05, min_tokens=2,
                max_tokens=9, stop_token_ids=[0, 999], logit_bias={"5": 100, "0012": -100, "7": 0.5}, top_k=-1)
    r = await client.post(URL, json=body, headers=auth)
    assert r.status_code == 200, r.text
    s = backend.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens, s.top_k) == (
        -2.0, 1.5, 1.1, 0.05, 2, -1)
    assert s.stop_token_ids == (0, 999) and s.logit_bias == ((5, 100.0), (12, -100.0), (7, 0.5))
    await client.post(URL, json=chat("hi"), headers=auth)  # defaults: all off
    s = backend.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens, s.logit_bias,
            s.stop_token_ids) == (0.0, 0.0, 1.0, 0.0, 0, (), ())
    assert not s.uses_logits_processors


BAD = [
    ({"n": 0}, "n"), ({"n": 9}, "n"), ({"n": 1.5}, "n"), ({"n": "2"}, "n"),
    ({"presence_penalty": 2.01}, "presence_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"), ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1000": 1}}, "logit_bias"),  # the FakeBackend's vocabulary has 1000 ids
    ({"logit_bias": {"5": "1"}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.01}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"), ({"stop_token_ids": [3, 1000]}, "stop_token_ids[1]"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
async def test_out_of_range_sampling_values_400_name_the_field(client, auth, backend, extra, param):
    r = await client.post(URL, json=chat(stream=True, **extra), headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", param)
    assert backend.requests == []


# ------------------------------------------------------------------ the real engine


@pytest.fixture(scope="module")
async def engine_app(tmp_path_factory, migrated_template, target_fp32, tokenizer):
    """(client, headers) on the gateway over the real engine (fp32, prompt lookup verifying
    every round, so the processors also run per verified position)."""
    async with served_engine(tmp_path_factory, migrated_template, "sampling", target_fp32, tokenizer,
                             max_batch_size=8, spec_method="prompt_lookup", spec_policy="fixed",
                             spec_gate=False) as (_, c, headers):
        yield c, headers


async def ask(engine_app, content: str, **extra) -> dict:
    c, h = engine_app
    r = await c.post(URL, json={"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
                                **extra}, headers=h)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.model
async def test_logit_bias_forces_and_bans_tokens(engine_app, tokenizer):
    banana = tokenizer.encode(" banana", add_special_tokens=False)
    assert len(banana) == 1
    forced = await ask(engine_app, "What is the capital of France?", max_tokens=4, logit_bias={str(banana[0]): 100})
    assert forced["choices"][0]["message"]["content"] == " banana" * 4
    plain = await ask(engine_app, "What is the capital of France?", max_tokens=8, logprobs=True)
    first = plain["choices"][0]["logprobs"]["content"][0]["token"]
    ids = tokenizer.encode(first, add_special_tokens=False)
    assert len(ids) == 1 and tokenizer.decode(ids) == first
    banned = await ask(engine_app, "What is the capital of France?", max_tokens=8, logprobs=True,
                       logit_bias={str(ids[0]): -100})
    tokens = [e["token"] for e in banned["choices"][0]["logprobs"]["content"]]
    assert tokens and first not in tokens, (first, tokens)
    # logprobs stay the raw model's: the banned token is still the most likely one of row 0
    assert banned["choices"][0]["logprobs"]["content"][0]["logprob"] < plain["choices"][0]["logprobs"]["content"][0]["logprob"]


@pytest.mark.model
async def test_min_tokens_holds_eos_back_and_stop_token_ids_end_the_reply(engine_app, tokenizer):
    short = await ask(engine_app, "Is the sky blue? Answer yes or no.", max_tokens=40)
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 15
    held = await ask(engine_app, "Is the sky blue? Answer yes or no.", max_tokens=40, min_tokens=20)
    assert held["usage"]["completion_tokens"] >= 20
    assert held["choices"][0]["message"]["content"].startswith(short["choices"][0]["message"]["content"])
    banana = str(tokenizer.encode(" banana", add_special_tokens=False)[0])
    stopped = await ask(engine_app, "Say hi.", max_tokens=10, logit_bias={banana: 100}, stop_token_ids=[int(banana)])
    assert (stopped["choices"][0]["message"]["content"], stopped["choices"][0]["finish_reason"],
            stopped["usage"]["completion_tokens"]) == ("", "stop", 1)
    # min_tokens suppresses the stop token too: three other tokens, then the forced one ends it
    later = await ask(engine_app, "Say hi.", max_tokens=10, logit_bias={banana: 100}, stop_token_ids=[int(banana)],
                      min_tokens=3)
    assert later["choices"][0]["finish_reason"] == "stop" and later["usage"]["completion_tokens"] == 4
    assert "banana" not in later["choices"][0]["message"]["content"]


@pytest.mark.model
async def test_seeded_choices_are_the_single_requests_with_seed_plus_i(engine_app):
    prompt = "Write a line about the sea."
    many = await ask(engine_app, prompt, n=3, seed=11, temperature=1.0, max_tokens=8, presence_penalty=1.0)
    texts = [c["message"]["content"] for c in many["choices"]]
    singles = [await ask(engine_app, prompt, seed=11 + i, temperature=1.0, max_tokens=8, presence_penalty=1.0)
               for i in range(3)]
    assert [one["choices"][0]["message"]["content"] for one in singles] == texts
    assert len(set(texts)) > 1
    assert many["usage"]["completion_tokens"] == sum(one["usage"]["completion_tokens"] for one in singles)
    assert many["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]

"""The ``/v1/completions`` body of the OpenAI-compatible upstream backend
(:func:`runtime.upstream.payload.build_completions_payload`) and the chunk parser
(:func:`runtime.upstream.chunks.parse_chunk`): pure functions, no server."""

from __future__ import annotations

import pytest

from runtime.interface import GenerationRequest, GrammarError, ResponseFormat, SamplingParams, ToolSchema
from runtime.upstream.assembler import ProtocolError
from runtime.upstream.chunks import UpstreamStreamError, parse_chunk
from runtime.upstream.config import UpstreamConfig
from runtime.upstream.payload import build_completions_payload

PROMPT = [1, 9690, 198, 2683]


def body(sampling: SamplingParams = SamplingParams(), config: UpstreamConfig = UpstreamConfig(), **request) -> dict:
    return build_completions_payload(GenerationRequest("chatcmpl-1", PROMPT, sampling, **request), config)


def test_defaults_send_only_the_openai_fields_and_the_rest_of_the_context():
    assert body(config=UpstreamConfig(max_context=100)) == {
        "model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": 96, "temperature": 1.0, "top_p": 1.0,
    }


def test_every_sampling_field_is_mapped():
    s = SamplingParams(temperature=0.3, top_p=0.9, top_k=40, max_tokens=12, stop=("\n\n", "END"), seed=7,
                       ignore_eos=True, logprobs=3, presence_penalty=0.5, frequency_penalty=-0.25,
                       repetition_penalty=1.1, logit_bias=((42, -100.0), (7, 2.5)), min_p=0.05, min_tokens=2,
                       stop_token_ids=(2, 13))
    config = UpstreamConfig(model="served-name", return_token_ids=True, send_priority=True, send_cache_salt=True)
    assert body(s, config, priority=3, cache_salt="acme") == {
        "model": "served-name", "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 12, "temperature": 0.3, "top_p": 0.9, "top_k": 40, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 2,
        "logit_bias": {"42": -100.0, "7": 2.5}, "seed": 7, "stop": ["\n\n", "END"], "stop_token_ids": [2, 13],
        "ignore_eos": True, "logprobs": 3, "return_tokens_as_token_ids": True, "return_token_ids": True,
        "priority": -3, "cache_salt": "acme",
    }


def test_priority_order_follows_the_server():
    vllm = UpstreamConfig(send_priority=True)  # vLLM: lower values run first → negated
    sglang = UpstreamConfig(send_priority=True, priority_low_values_first=False)
    assert body(config=vllm, priority=5)["priority"] == -5
    assert body(config=sglang, priority=5)["priority"] == 5
    assert "priority" not in body(priority=5)  # off by default: a server without priority scheduling refuses it


def test_a_prompt_that_fills_the_context_is_refused():
    with pytest.raises(ValueError, match="leaves no room in a 4-token context"):
        body(config=UpstreamConfig(max_context=4))


def test_response_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert body(response_format=ResponseFormat("json_object"))["response_format"] == {"type": "json_object"}
    assert body(response_format=ResponseFormat("json_schema", schema, strict=True))["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "response", "schema": schema, "strict": True}}
    tools = (ToolSchema("get_weather", {"type": "object"}),)
    # free "auto" tools: no constraint sent, the gateway parses the reply
    assert "response_format" not in body(response_format=ResponseFormat("tool_calls", tools=tools, tool_choice="auto"))
    for fmt in (ResponseFormat("tool_calls", tools=tools, tool_choice="required"),
                ResponseFormat("tool_calls", tools=tools, tool_choice="auto", reply=ResponseFormat("json_object"))):
        with pytest.raises(GrammarError, match="cannot constrain its output to tool calls") as err:
            body(response_format=fmt)
        assert err.value.code == "unsupported_parameter" and err.value.tool is None


# -- chunks ---------------------------------------------------------------------------------------

def chunk(text="", finish=None, **choice) -> dict:
    return {"id": "cmpl-x", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": finish, **choice}]}


def test_text_finish_and_usage():
    c = parse_chunk(chunk(" hi", token_ids=[5, 6]), None)
    assert (c.text, c.token_ids, c.finish_reason, c.usage, c.logprobs) == (" hi", [5, 6], None, None, None)
    c = parse_chunk(chunk("", "stop", matched_stop="END"), None)
    assert (c.finish_reason, c.matched_stop) == ("stop", "END")
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
    c = parse_chunk({"object": "text_completion", "choices": [], "usage": usage}, None)
    assert (c.text, c.usage, c.finish_reason) == ("", usage, None)


def test_openai_logprobs_with_token_ids_sorted_and_cut_to_n():
    lp = {"tokens": ["token_id:11", "token_id:12"], "token_logprobs": [-0.1, -2.0],
          "top_logprobs": [{"token_id:11": -0.1, "token_id:30": -3.0, "token_id:31": -2.5},
                           {"token_id:40": -0.5, "token_id:41": -1.0, "token_id:12": -2.0}]}
    c = parse_chunk(chunk("ab", logprobs=lp), 2)
    assert c.token_ids == [11, 12]
    assert [(e.token_id, e.logprob, e.top) for e in c.logprobs] == [
        (11, -0.1, [(11, -0.1), (31, -2.5)]), (12, -2.0, [(40, -0.5), (41, -1.0)])]
    assert parse_chunk(chunk("ab", logprobs=lp), None).logprobs is None  # not asked for: ignored
    with pytest.raises(ProtocolError, match="return_tokens_as_token_ids"):
        parse_chunk(chunk("a", logprobs={"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [None]}), 1)


def test_llama_server_logprobs():
    lp = {"content": [{"id": 7, "token": "a", "logprob": -0.2,
                       "top_logprobs": [{"id": 9, "logprob": -3.0}, {"id": 7, "logprob": -0.2}]}]}
    c = parse_chunk(chunk("a", logprobs=lp), 1)
    assert c.token_ids == [7] and [(e.token_id, e.logprob, e.top) for e in c.logprobs] == [(7, -0.2, [(7, -0.2)])]


def test_error_objects_and_malformed_chunks():
    with pytest.raises(UpstreamStreamError) as err:
        parse_chunk({"error": {"message": "boom", "type": "InternalServerError", "code": 500}}, None)
    assert (err.value.message, err.value.status) == ("boom", 500)
    with pytest.raises(UpstreamStreamError) as err:  # older vLLM
        parse_chunk({"object": "error", "message": "queue full", "type": "x", "code": 503}, None)
    assert (err.value.message, err.value.status) == ("queue full", 503)
    for bad, what in ((["x"], "not an object"), ({"choices": None}, "no choices"),
                      (chunk(3), "text is not a string"), (chunk("a", token_ids=["x"]), "token_ids"),
                      (chunk("a", finish=1), "finish_reason")):
        with pytest.raises(ProtocolError, match=what):
            parse_chunk(bad, None)

"""SGLang wire mapping without a server: request payload, spec stats, chunk assembly
(cumulative / incremental / stop-string hold-back) and the recorded 0.5.23 contract."""

from __future__ import annotations

import pytest

from runtime.interface import GenerationRequest, SamplingParams
from runtime.sglang.client import (
    ProtocolError,
    SGLangConfig,
    StreamAssembler,
    build_generate_payload,
    spec_stats_from_meta,
)
from tests.support.sglang_standin import ContractError, validate, validate_chunk


def _req(**kw) -> GenerationRequest:
    sampling = kw.pop("sampling", SamplingParams())
    return GenerationRequest(request_id=kw.pop("request_id", "chatcmpl-1"),
                             prompt_token_ids=kw.pop("prompt", [5, 6, 7]), sampling=sampling, **kw)


def test_payload_maps_sampling_sla_priority_and_rid():
    cfg = SGLangConfig(max_context=100, send_priority=True, sla_max_weight=3.0)
    req = _req(sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=12,
                                       stop=("###", "END"), seed=1234, ignore_eos=True),
               sla_target_tokens_per_s=42.5, priority=7)
    body = build_generate_payload(req, cfg)
    assert body == {
        "rid": "chatcmpl-1",
        "input_ids": [5, 6, 7],
        "stream": True,
        "priority": 7,
        "sampling_params": {
            "max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "ignore_eos": True,
            "stop": ["###", "END"], "sampling_seed": 1234,
            "custom_params": {"sparkgate_sla_target_tokens_per_s": 42.5, "sparkgate_sla_max_weight": 3.0},
        },
    }
    validate("GenerateRequest", body)
    validate("SamplingParams", body["sampling_params"])


def test_payload_defaults_fill_the_context_and_disable_top_k():
    body = build_generate_payload(_req(prompt=list(range(30))), SGLangConfig(max_context=100))
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 70  # not SGLang's default of 128
    assert sp["top_k"] == -1  # our 0 = disabled; SGLang rejects 0
    assert "stop" not in sp and "sampling_seed" not in sp and "custom_params" not in sp
    assert "priority" not in body  # send_priority off: the server may run without priorities
    with pytest.raises(ValueError, match="no room"):
        build_generate_payload(_req(prompt=list(range(100))), SGLangConfig(max_context=100))


def test_payload_passes_penalties_logit_bias_and_stop_ids_through():
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.05,
                        min_tokens=3, logit_bias=((17, -100.0), (5, 2.5)), stop_token_ids=(2, 9))
    body = build_generate_payload(_req(sampling=sp), SGLangConfig(max_context=100))
    got = {k: v for k, v in body["sampling_params"].items() if k not in ("max_new_tokens", "temperature", "top_p",
                                                                         "top_k", "ignore_eos")}
    assert got == {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.2, "min_p": 0.05,
                   "min_new_tokens": 3, "logit_bias": {"17": -100.0, "5": 2.5}, "stop_token_ids": [2, 9]}
    validate("SamplingParams", body["sampling_params"])
    # neutral values are not sent at all
    assert set(build_generate_payload(_req(), SGLangConfig(max_context=100))["sampling_params"]) == {
        "max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos"}


def test_payload_priority_inverted_for_low_values_first():
    cfg = SGLangConfig(send_priority=True, priority_low_values_first=True)
    assert build_generate_payload(_req(priority=3), cfg)["priority"] == -3


def test_contract_rejects_unknown_sampling_keys_and_bad_types():
    with pytest.raises(ContractError, match="unknown field `max_tokens`"):
        validate("SamplingParams", {"max_tokens": 5})
    with pytest.raises(ContractError, match="input_ids"):
        validate("GenerateRequest", {"input_ids": ["a"]})
    validate("GenerateRequest", {"input_ids": [[1, 2], [3]], "rid": ["a", "b"], "future_field": 1})
    with pytest.raises(ContractError, match="unsigned"):
        validate("GenerateMetaInfo", {"completion_tokens": -1})
    with pytest.raises(ContractError, match="unknown type"):
        validate_chunk({"text": "", "meta_info": {"finish_reason": {"type": "weird"}}})
    assert validate_chunk({"error": {"message": "x", "code": 400, "type": "t"}}) == "error"


def test_spec_stats_mapping():
    meta = {
        "completion_tokens": 20, "spec_verify_ct": 6, "spec_num_correct_drafts": 14,
        "spec_num_proposed_drafts": 42, "spec_accept_length": 20 / 6, "spec_cap_length": 4.5,
        # rounds accepting 0,1,2,3,4 drafts: 1,0,2,2,1  → 0+0+4+6+4 = 14
        "spec_correct_drafts_histogram": [1, 0, 2, 2, 1],
        # verify lengths incl. anchor: 3×4 + 3×5 = 27 = 4.5·6
        "spec_cap_lens_histogram": [0, 0, 0, 0, 3, 3],
    }
    s = spec_stats_from_meta(meta)
    assert (s.rounds, s.drafted, s.accepted, s.emitted) == (6, 42, 14, 20)
    assert s.verified == 27 - 6
    assert s.accepted_per_position == [5, 5, 3, 1]  # ≥1, ≥2, ≥3, ≥4 accepted
    assert sum(s.accepted_per_position) == s.accepted
    assert s.tau == pytest.approx(meta["spec_accept_length"])
    # without the histogram: from spec_cap_length; without either: verify-all
    del meta["spec_cap_lens_histogram"]
    assert spec_stats_from_meta(meta).verified == 21
    del meta["spec_cap_length"]
    assert spec_stats_from_meta(meta).verified == 42
    assert spec_stats_from_meta({"completion_tokens": 5}) is None
    assert spec_stats_from_meta({"spec_verify_ct": 0}) is None


def _run(asm: StreamAssembler, chunks) -> list:
    out = []
    for text, ids, ct in chunks:
        asm.feed(text, ids, ct)
        d = asm.release()
        if d is not None:
            out.append(d)
    return out


def test_assembler_cumulative_and_incremental_give_the_same_deltas():
    cumulative = [("He", [1], 1), ("Hello wo", [1, 2, 3], 3), ("Hello world", [1, 2, 3, 4], 4)]
    incremental = [("He", [1], 1), ("llo wo", [2, 3], 3), ("rld", [4], 4)]
    for chunks, mode in ((cumulative, False), (incremental, True)):
        for forced in (None, mode):
            asm = StreamAssembler(incremental=forced)
            deltas = _run(asm, chunks)
            assert [d.text for d in deltas] == ["He", "llo wo", "rld"]
            assert [d.num_tokens for d in deltas] == [1, 2, 1]
            assert [d.token_ids for d in deltas] == [[1], [2, 3], [4]]
            assert asm.incremental is mode


def test_assembler_detects_incremental_by_text_without_output_ids():
    asm = StreamAssembler()
    deltas = _run(asm, [("ab", None, 1), ("cd", None, 2)])
    assert asm.incremental is True and "".join(d.text for d in deltas) == "abcd"


def test_assembler_rejects_cumulative_text_that_does_not_extend():
    asm = StreamAssembler(incremental=False)
    asm.feed("abc", [1], 1)
    with pytest.raises(ProtocolError):
        asm.feed("xbcd", [1, 2], 2)


def test_assembler_drops_the_stop_prefix_sglang_already_streamed():
    # SGLang 0.5.23 streams "Hi #", "Hi ##"; the next token completes "###", and the
    # detokenizer trims only the unsent tail, so the final cumulative text is still "Hi ##".
    asm = StreamAssembler(stop=("###",), incremental=False)
    d1 = _run(asm, [("Hi #", [1, 2], 2)])
    assert [(d.text, d.num_tokens) for d in d1] == [("Hi ", 2)]  # "#" may start "###": held back
    asm.feed("Hi ##", [1, 2, 3], 3)
    assert asm.release() is None  # still only a stop prefix; its token stays pending
    asm.feed("Hi ##", [1, 2, 3, 4], 4)
    last = asm.release(final=True, matched="###")
    assert (last.text, last.num_tokens, last.token_ids) == ("", 2, [3, 4])


def test_assembler_final_release_keeps_text_that_only_looks_like_a_stop_prefix():
    asm = StreamAssembler(stop=("###",), incremental=True)
    assert _run(asm, [("a #", [1], 1)])[0].text == "a "
    last = asm.release(final=True, matched=None)  # finished by EOS / length
    assert last.text == "#"


def test_assembler_never_releases_a_stop_string():
    asm = StreamAssembler(stop=("END",), incremental=True)
    deltas = _run(asm, [("abc E", [1], 1), ("N", [2], 2), ("D tail", [3], 3)])
    final = asm.release(final=True, matched="END")
    text = "".join(d.text for d in deltas) + (final.text if final else "")
    assert text == "abc "
    assert deltas[0].text == "abc "  # " E" → " " released, "E" held back


def _sglang_cut(tokenizer, ids: list[int], final_ids: list[int], tokenizer_arg) -> tuple[str, int]:
    """Cumulative chunks as SGLang 0.5.23 streams them: a trailing U+FFFD is held back
    while streaming, the final chunk has the whole decode (an incomplete last character
    rendered as U+FFFD). Returns the assembled text and token count."""
    asm = StreamAssembler(incremental=False, tokenizer=tokenizer_arg)
    deltas = []
    for k in range(1, len(ids)):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        deltas += _run(asm, [(text[:-1] if text.endswith("\ufffd") else text, ids[:k], k)])
    asm.feed(tokenizer.decode(final_ids, skip_special_tokens=True), final_ids, len(final_ids))
    last = asm.release(final=True)
    deltas += [last] if last is not None else []
    return "".join(d.text for d in deltas), sum(d.num_tokens for d in deltas)


def test_assembler_drops_an_incomplete_last_character_like_the_engine(tokenizer):
    from runtime.engine.detokenizer import Detokenizer

    text = "👋🎉 你好世界"
    ids = tokenizer.encode(text)
    for n in range(1, len(ids) + 1):
        det = Detokenizer(tokenizer, [1], SamplingParams(), 2, n)
        want = det.append(ids).text  # the embedded engine's reply at max_tokens = n
        assert "\ufffd" not in want
        assert _sglang_cut(tokenizer, ids[:n], ids[:n], tokenizer) == (want, n)  # finish "length"
        assert _sglang_cut(tokenizer, ids[:n], ids[:n] + [2], tokenizer) == (want, n + 1)  # EOS
    # without a tokenizer the final text stays as SGLang sent it
    assert _sglang_cut(tokenizer, ids[:2], ids[:2], None)[0] == "\ufffd"
    # a U+FFFD the model generated as a complete character is kept
    ids = tokenizer.encode("a\ufffd")
    assert _sglang_cut(tokenizer, ids, ids, tokenizer) == ("a\ufffd", len(ids))


def test_payload_maps_response_formats_to_sglang_constraint_fields():
    """json_object / json_schema → ``json_schema`` (a JSON string, as SGLang's own OpenAI adapter
    sends them); tool calls → ``structural_tag``, the embedded engine's tag with each tool's
    arguments as ``json_schema`` content; free text sends none of them."""
    import json

    from runtime.engine.tool_grammar import CALL_CLOSING, call_opening
    from runtime.interface import ResponseFormat, ToolSchema
    from tests.support.tools import SCHEMAS

    cfg = SGLangConfig(max_context=100)
    sp = lambda fmt: build_generate_payload(_req(response_format=fmt), cfg)["sampling_params"]  # noqa: E731
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert sp(ResponseFormat("json_object"))["json_schema"] == '{"type": "object"}'
    assert sp(ResponseFormat("json_schema", None))["json_schema"] == '{"type": "object"}'
    got = sp(ResponseFormat("json_schema", schema, strict=True))
    assert json.loads(got["json_schema"]) == schema and "structural_tag" not in got
    tools = tuple(ToolSchema(name, params) for name, params in SCHEMAS.items()) + (ToolSchema("ping"),)
    for choice, parallel, kind in (("required", True, "tags_with_separator"), ("auto", False, "triggered_tags")):
        got = sp(ResponseFormat("tool_calls", tools=tools, tool_choice=choice, parallel_tool_calls=parallel))
        assert "json_schema" not in got
        tag = json.loads(got["structural_tag"])
        fmt = tag["format"]
        assert tag["type"] == "structural_tag" and fmt["type"] == kind and fmt["stop_after_first"] is (not parallel)
        assert [t["begin"] for t in fmt["tags"]] == [call_opening(t.name) for t in tools]
        assert {t["end"] for t in fmt["tags"]} == {CALL_CLOSING}
        assert [t["content"] for t in fmt["tags"]] == [
            {"type": "json_schema", "json_schema": SCHEMAS["get_weather"]},
            {"type": "json_schema", "json_schema": SCHEMAS["add"]},
            {"type": "json_schema", "json_schema": {"type": "object", "properties": {}}}]  # no parameters: {}
        validate("SamplingParams", got)
    assert not {"json_schema", "regex", "ebnf", "structural_tag"} & set(sp(None))

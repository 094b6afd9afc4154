"""``docs/api.md`` keeps up with the request models (issue 29: "lists every request field with
its status beside OpenAI's and vLLM's").

Each request endpoint's section has one table headed :data:`HEADER`; its first cell names one
or more fields in backticks, its second starts with a bold status word (:data:`STATUSES`).
Checked here, against the pydantic models the routes validate:

* every field of :class:`ChatCompletionRequest`, :class:`CompletionRequest` and
  :class:`ResponsesRequest` has a row in its endpoint's table (a field added to a schema
  without a row fails), and no field has two;
* a row that is not **ignored** names a field of that model (a row promising a field the
  schema does not have fails: an undeclared field is dropped, so it can only be ignored);
* unknown fields are dropped, as the doc says (``extra="ignore"``);
* every **neutral only** and **partly** row behaves as written: its sample neutral value is
  accepted and its sample refused value is a 400 ``unsupported_parameter`` naming the field,
  from the gateway's own checks (:data:`SAMPLES`; a new such row needs a sample).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from pydantic import BaseModel, create_model

from gateway.core.errors import APIError
from gateway.openai.responses_input import check_parameters
from gateway.openai.responses_schemas import ResponsesRequest
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.translate import reject_unsupported_chat, reject_unsupported_completion
from tests.support import ROOT

DOC = ROOT / "docs" / "api.md"
HEADER = "| field | here | OpenAI | vLLM |"
STATUSES = ("supported", "partly", "neutral only", "ignored")
ENDPOINTS = {
    "POST /v1/chat/completions": ChatCompletionRequest,
    "POST /v1/completions": CompletionRequest,
    "POST /v1/responses": ResponsesRequest,
}
MESSAGES = [{"role": "user", "content": "Hi"}]
BASE = {ChatCompletionRequest: {"model": "m", "messages": MESSAGES}, CompletionRequest: {"model": "m", "prompt": "Hi"},
        ResponsesRequest: {"model": "m", "input": "Hi"}}
REFUSE = {ChatCompletionRequest: reject_unsupported_chat, CompletionRequest: reject_unsupported_completion,
          ResponsesRequest: check_parameters}
#: (endpoint, field) → (a value the doc says is accepted, a value it says is refused by name)
SAMPLES = {
    ("POST /v1/chat/completions", "functions"): ([], [{"name": "f"}]),
    ("POST /v1/chat/completions", "function_call"): ("none", "auto"),
    ("POST /v1/chat/completions", "modalities"): (["text"], ["text", "audio"]),
    ("POST /v1/chat/completions", "audio"): (None, {"voice": "alloy", "format": "wav"}),
    ("POST /v1/chat/completions", "prediction"): (None, {"type": "content", "content": "x"}),
    ("POST /v1/chat/completions", "web_search_options"): (None, {}),
    ("POST /v1/chat/completions", "structured_outputs"): ({"json": {"type": "object"}}, {"regex": "a+"}),
    ("POST /v1/chat/completions", "guided_regex"): (None, "a+"),
    ("POST /v1/chat/completions", "guided_choice"): (None, ["a", "b"]),
    ("POST /v1/chat/completions", "guided_grammar"): (None, "root ::= \"a\""),
    ("POST /v1/completions", "best_of"): (1, 2),
    ("POST /v1/completions", "echo"): (False, True),
    ("POST /v1/completions", "suffix"): ("", "x"),
    ("POST /v1/responses", "background"): (False, True),
    ("POST /v1/responses", "context_management"): ([], [{"type": "compaction"}]),
    ("POST /v1/responses", "conversation"): ({}, "conv_123"),
    ("POST /v1/responses", "prompt"): (None, {"id": "pmpt_123"}),
    ("POST /v1/responses", "top_logprobs"): (0, 1),
    ("POST /v1/responses", "truncation"): ("disabled", "auto"),
    ("POST /v1/responses", "include"): (["reasoning.encrypted_content"], ["message.output_text.logprobs"]),
    ("POST /v1/responses", "reasoning"): ({"effort": "none"}, {"effort": "high"}),
    ("POST /v1/responses", "service_tier"): ("auto", "flex"),
}


@dataclass(frozen=True)
class Row:
    """One row of a field table: the fields its first cell names, its status word, its line."""

    names: tuple[str, ...]
    status: str
    line: int


def section(text: str, heading: str) -> str:
    """The text under ``## <heading>`` up to the next ``## `` heading."""
    parts = text.split(f"\n## {heading}\n", 1)
    assert len(parts) == 2, f"docs/api.md has no section '## {heading}'"
    return parts[1].split("\n## ", 1)[0]


def field_rows(text: str, first_line: int = 1) -> list[Row]:
    """The rows of the table headed :data:`HEADER` in ``text`` (a section of the doc)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == HEADER), None)
    assert start is not None, f"no table headed {HEADER!r}"
    rows = []
    for i in range(start + 2, len(lines)):  # the header, then the |---| line
        if not lines[i].startswith("|"):
            break
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        status = re.match(r"\*\*([^*]+)\*\*", cells[1])
        rows.append(Row(tuple(re.findall(r"`([^`]+)`", cells[0])), status[1] if status else cells[1],
                        first_line + i))
    return rows


def endpoint_rows(endpoint: str) -> list[Row]:
    text = DOC.read_text(encoding="utf-8")
    body = section(text, endpoint)
    return field_rows(body, text[:text.index(body)].count("\n") + 1)


def wire_names(model: type[BaseModel]) -> set[str]:
    """The top-level field names a request spells (aliases where a field has one)."""
    return {f.alias or name for name, f in model.model_fields.items()}


def problems(model: type[BaseModel], rows: list[Row]) -> list[str]:
    """What is wrong with ``rows`` as the field table of ``model`` (module docstring)."""
    fields, out, seen = wire_names(model), [], {}
    for row in rows:
        if not row.names:
            out.append(f"line {row.line}: the first cell names no field in backticks")
        if row.status not in STATUSES:
            out.append(f"line {row.line}: status {row.status!r} is none of {STATUSES}")
        for name in row.names:
            if name in seen:
                out.append(f"`{name}` has two rows (lines {seen[name]} and {row.line})")
            seen[name] = row.line
            if row.status != "ignored" and name not in fields:
                out.append(f"line {row.line}: `{name}` is {row.status!r} but {model.__name__} has no such field "
                           "(an undeclared field is dropped: it can only be 'ignored')")
    out += [f"{model.__name__}.{name} has no row" for name in sorted(fields - set(seen))]
    return out


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_request_field_has_a_row_and_every_row_not_ignored_is_a_field(endpoint):
    model, rows = ENDPOINTS[endpoint], endpoint_rows(endpoint)
    assert problems(model, rows) == []
    assert model.model_config["extra"] == "ignore"  # "any field that is in no table is ignored too"
    assert len(rows) >= 20 and {"model", "stream", "temperature"} <= {n for r in rows for n in r.names}


def test_the_check_fails_for_an_undocumented_field_and_for_a_promised_one():
    """A schema field without a row, a row promising a field the schema lacks, a second row
    for one field and an unknown status word are each reported."""
    rows = endpoint_rows("POST /v1/chat/completions")
    grown = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, brand_new_knob=(int | None, None))
    assert problems(grown, rows) == ["ChatCompletionRequest.brand_new_knob has no row"]
    bad = [*rows, Row(("guided_decoding_backend",), "supported", 999), Row(("seed",), "ignored", 1000), Row(("x",), "maybe", 1001)]
    found = problems(ChatCompletionRequest, bad)
    assert any("`guided_decoding_backend` is 'supported'" in p for p in found)
    assert any(p.startswith("`seed` has two rows") for p in found)
    assert any("status 'maybe'" in p for p in found)


def _refusal(model: type[BaseModel], field: str, value) -> APIError | None:
    body = model.model_validate({**BASE[model], field: value})
    try:
        REFUSE[model](body)
    except APIError as exc:
        return exc
    return None


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_neutral_only_and_partly_rows_accept_and_refuse_as_written(endpoint):
    model = ENDPOINTS[endpoint]
    limited = [n for r in endpoint_rows(endpoint) if r.status in ("neutral only", "partly") for n in r.names]
    assert limited, "every endpoint refuses some OpenAI values by name"
    no_sample = [n for n in limited if (endpoint, n) not in SAMPLES]
    assert not no_sample, f"add an (accepted, refused) pair to SAMPLES for {no_sample}"
    for name in limited:
        accepted, refused = SAMPLES[endpoint, name]
        assert _refusal(model, name, accepted) is None, (name, accepted)
        err = _refusal(model, name, refused)
        assert err is not None, f"{name}={refused!r} should be refused"
        assert (err.status, err.code) == (400, "unsupported_parameter") and err.param.startswith(name), \
            (name, err.status, err.code, err.param)
    stale = [k for k in SAMPLES if k[0] == endpoint and k[1] not in limited]
    assert not stale, f"SAMPLES for rows that are no longer 'neutral only' or 'partly': {stale}"

"""Build the OpenAI response objects of one request: streamed chunks and the
non-streamed result, for chat (``chat.completion[.chunk]``) and legacy completions
(``text_completion``). All chunks of a request share ``id``, ``created`` and ``model``.

``spec_stats`` (our extension, :meth:`SpecStats.to_dict`) is serialized only when the
request asked for it (``return_spec_stats``), on the finishing chunk / final object.
``logprobs`` (when asked, :class:`gateway.openai.logprobs.LogprobsBuilder`) ride on every
content chunk (the tokens of that step) and on the final object (all tokens).

A chat request with tools (``tool_calls=True``) has its reply parsed
(:mod:`gateway.openai.tool_parser`): streamed, a call's first chunk carries ``index``, ``id``,
``type`` and ``function.name`` (``arguments: ""``), the following ones fragments of
``function.arguments``; text outside the calls streams as ``content``. A reply with calls
that ended by EOS finishes with ``"tool_calls"``; whole, its message has ``tool_calls`` and
``content`` ``null`` when it has no text.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Sequence

from pydantic import BaseModel

from gateway.openai.logprobs import LogprobsBuilder
from gateway.openai.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    CompletionChoice,
    FunctionCall,
    PromptTokensDetails,
    TextCompletion,
    ToolCall,
    Usage,
)
from gateway.openai.tool_parser import Piece, ToolCallParser, parse_tool_calls
from runtime.interface import Finished, FinishReason, TokenLogprob


def new_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…`` id (prefix + 32 hex chars)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> bytes:
    """One SSE event: ``data: <compact json>\\n\\n`` (UTF-8, non-ASCII kept as is)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def json_string(text: str) -> bytes:
    """``text`` as a JSON string, encoded exactly as :func:`sse` encodes it inside an object."""
    return json.dumps(text, ensure_ascii=False).encode()


#: A text no model streams, standing for the text in a chunk template (:meth:`_Formatter.delta_sse`).
_SLOT = "\x00sparkgate-text-slot\x00"


class _Formatter:
    id_prefix = ""

    def __init__(self, model: str, prompt_tokens: int, return_spec_stats: bool,
                 logprobs: LogprobsBuilder | None = None):
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.return_spec_stats = return_spec_stats
        self.logprobs = logprobs  # None: the request did not ask for logprobs
        self._template: tuple[bytes, bytes] | None = None  # (before, after) the text of a plain content chunk

    @property
    def num_top_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` for this request."""
        return self.logprobs.num_top if self.logprobs is not None else None

    def usage(self, finished: Finished) -> Usage:
        details = None if finished.cached_tokens is None else PromptTokensDetails(cached_tokens=finished.cached_tokens)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=finished.completion_tokens,
                     total_tokens=self.prompt_tokens + finished.completion_tokens, prompt_tokens_details=details)

    def spec_stats(self, finished: Finished) -> dict | None:
        return finished.spec.to_dict() if finished.spec is not None else None

    def dump(self, obj: BaseModel, final: bool = False) -> dict:
        """JSON-ready dict; ``spec_stats`` kept only on the final object when requested."""
        keep = final and self.return_spec_stats
        return obj.model_dump(mode="json", exclude=None if keep else {"spec_stats"})

    def header(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> list[dict]:
        raise NotImplementedError

    def plain(self) -> bool:
        """Whether a step's chunks are one chunk whose only varying field is the text."""
        return self.logprobs is None

    def delta_sse(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """The SSE bytes of :meth:`delta`'s chunks (:func:`sse` of each, joined; ``b""`` for none).

        A :meth:`plain` step, the streaming hot path, is built from a template: the bytes of
        the same chunk made once through the models with a placeholder text, split around it,
        so the result is byte for byte what the models give, at a tenth of the cost."""
        if self._template is None and self.plain():
            (chunk,) = self.delta(_SLOT)
            parts = sse(chunk).split(json_string(_SLOT))
            self._template = (parts[0], parts[1]) if len(parts) == 2 else (b"", b"")
        if not self.plain() or not self._template[0]:
            return b"".join(sse(p) for p in self.delta(text, logprobs))
        before, after = self._template
        return before + json_string(text) + after


def tool_deltas(pieces: Sequence[Piece]) -> list[dict]:
    """Parsed pieces → chat ``delta`` objects, in order: runs of content joined, a call's
    start as ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}``,
    runs of one call's argument fragments joined as ``{"tool_calls": [{"index", "function":
    {"arguments"}}]}``."""
    out: list[dict] = []
    for p in pieces:
        last = out[-1] if out else None
        if p.kind == "content":
            if last is not None and "content" in last:
                last["content"] += p.text
            else:
                out.append({"content": p.text})
        elif p.kind == "call":
            out.append({"tool_calls": [{"index": p.index, "id": p.id, "type": "function",
                                        "function": {"name": p.name, "arguments": ""}}]})
        elif last is not None and "tool_calls" in last and "id" not in last["tool_calls"][0] \
                and last["tool_calls"][0]["index"] == p.index:
            last["tool_calls"][0]["function"]["arguments"] += p.text
        else:
            out.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]})
    return out


class ChatFormatter(_Formatter):
    """Args (beyond the base's): ``tool_calls``: parse the reply for tool calls (module docstring)."""

    id_prefix = "chatcmpl"

    def __init__(self, model: str, prompt_tokens: int, return_spec_stats: bool,
                 logprobs: LogprobsBuilder | None = None, tool_calls: bool = False):
        super().__init__(model, prompt_tokens, return_spec_stats, logprobs)
        self.parser = ToolCallParser() if tool_calls else None

    def _chunk(self, choices: list[ChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.header(), choices=choices, **extra)

    def plain(self) -> bool:
        return self.logprobs is None and self.parser is None

    @staticmethod
    def finish_reason(finished: Finished, calls: int) -> str:
        """``"tool_calls"`` for a reply with calls that ended by EOS, else the engine's reason."""
        return "tool_calls" if calls and finished.finish_reason is FinishReason.STOP else finished.finish_reason.value

    def _deltas(self, deltas: list[dict], logprobs: Sequence[TokenLogprob] | None) -> list[dict]:
        """One chunk per delta, the step's logprobs on the first (an empty delta carries them
        when the step decided nothing)."""
        lp = self._logprobs(logprobs) if logprobs is not None else None
        if not deltas and lp is not None:
            deltas = [{}]
        return [self.dump(self._chunk([ChunkChoice(delta=d, logprobs=lp if k == 0 else None)]))
                for k, d in enumerate(deltas)]

    def opening(self) -> list[dict]:
        """The role chunk OpenAI sends first: ``delta = {"role": "assistant", "content": ""}``."""
        return [self.dump(self._chunk([ChunkChoice(delta={"role": "assistant", "content": ""})]))]

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        return self.logprobs.chat(entries or []) if self.logprobs is not None else None

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> list[dict]:
        """The chunks of one step's text (one ``content`` chunk; with tools, what the text decided)."""
        if self.parser is None:
            return [self.dump(self._chunk([ChunkChoice(delta={"content": text}, logprobs=self._logprobs(logprobs))]))]
        return self._deltas(tool_deltas(self.parser.feed(text)), logprobs)

    def finish(self, finished: Finished) -> list[dict]:
        """With tools, the chunks of the text held back until the end; then the last chunk
        with choices: empty delta + ``finish_reason`` (+ ``spec_stats``)."""
        out, calls = [], 0
        if self.parser is not None:
            out = self._deltas(tool_deltas(self.parser.finish()), None)
            calls = len(self.parser.calls)
        chunk = self._chunk([ChunkChoice(delta={}, finish_reason=self.finish_reason(finished, calls))],
                            spec_stats=self.spec_stats(finished))
        return [*out, self.dump(chunk, final=True)]

    def usage_chunk(self, finished: Finished) -> dict:
        """``stream_options.include_usage``: ``choices: []`` and the full usage."""
        return self.dump(self._chunk([], usage=self.usage(finished)))

    def complete(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob] | None = None) -> dict:
        message, calls = AssistantMessage(content=text), 0
        if self.parser is not None:
            content, parsed = parse_tool_calls(text)
            calls = len(parsed)
            message = AssistantMessage(
                content=content or (None if parsed else ""),
                tool_calls=[ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                            for c in parsed] or None)
        obj = ChatCompletion(
            **self.header(),
            choices=[ChatChoice(message=message, logprobs=self._logprobs(logprobs),
                                finish_reason=self.finish_reason(finished, calls))],
            usage=self.usage(finished),
            spec_stats=self.spec_stats(finished),
        )
        return self.dump(obj, final=True)


class CompletionFormatter(_Formatter):
    id_prefix = "cmpl"

    def _obj(self, choices: list[CompletionChoice], **extra) -> TextCompletion:
        return TextCompletion(**self.header(), choices=choices, **extra)

    def opening(self) -> list[dict]:
        return []

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        return self.logprobs.completion(entries or []) if self.logprobs is not None else None

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> list[dict]:
        return [self.dump(self._obj([CompletionChoice(text=text, logprobs=self._logprobs(logprobs))]))]

    def finish(self, finished: Finished) -> list[dict]:
        obj = self._obj([CompletionChoice(text="", finish_reason=finished.finish_reason.value)],
                        spec_stats=self.spec_stats(finished))
        return [self.dump(obj, final=True)]

    def usage_chunk(self, finished: Finished) -> dict:
        return self.dump(self._obj([], usage=self.usage(finished)))

    def complete(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob] | None = None) -> dict:
        obj = self._obj([CompletionChoice(text=text, logprobs=self._logprobs(logprobs),
                                          finish_reason=finished.finish_reason.value)],
                        usage=self.usage(finished), spec_stats=self.spec_stats(finished))
        return self.dump(obj, final=True)


Formatter = ChatFormatter | CompletionFormatter

"""Build the OpenAI response objects of one request: streamed chunks and the
non-streamed result, for chat (``chat.completion[.chunk]``) and legacy completions
(``text_completion``). All chunks of a request share ``id``, ``created`` and ``model``.

``spec_stats`` (our extension, :meth:`SpecStats.to_dict`) is serialized only when the
request asked for it (``return_spec_stats``), on the finishing chunk / final object.
``logprobs`` (when asked, :class:`gateway.openai.logprobs.LogprobsBuilder`) ride on every
content chunk (the tokens of that step) and on the final object (all tokens).
"""

from __future__ import annotations

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
    PromptTokensDetails,
    TextCompletion,
    Usage,
)
from runtime.interface import Finished, TokenLogprob


def new_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…`` id (prefix + 32 hex chars)."""
    return f"{prefix}-{uuid.uuid4().hex}"


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


class ChatFormatter(_Formatter):
    id_prefix = "chatcmpl"

    def _chunk(self, choices: list[ChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.header(), choices=choices, **extra)

    def opening(self) -> list[dict]:
        """The role chunk OpenAI sends first: ``delta = {"role": "assistant", "content": ""}``."""
        return [self.dump(self._chunk([ChunkChoice(delta={"role": "assistant", "content": ""})]))]

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        return self.logprobs.chat(entries or []) if self.logprobs is not None else None

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> dict:
        return self.dump(self._chunk([ChunkChoice(delta={"content": text}, logprobs=self._logprobs(logprobs))]))

    def finish(self, finished: Finished) -> dict:
        """Last chunk with choices: empty delta + ``finish_reason`` (+ ``spec_stats``)."""
        chunk = self._chunk([ChunkChoice(delta={}, finish_reason=finished.finish_reason.value)],
                            spec_stats=self.spec_stats(finished))
        return self.dump(chunk, final=True)

    def usage_chunk(self, finished: Finished) -> dict:
        """``stream_options.include_usage``: ``choices: []`` and the full usage."""
        return self.dump(self._chunk([], usage=self.usage(finished)))

    def complete(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob] | None = None) -> dict:
        obj = ChatCompletion(
            **self.header(),
            choices=[ChatChoice(message=AssistantMessage(content=text), logprobs=self._logprobs(logprobs),
                                finish_reason=finished.finish_reason.value)],
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

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> dict:
        return self.dump(self._obj([CompletionChoice(text=text, logprobs=self._logprobs(logprobs))]))

    def finish(self, finished: Finished) -> dict:
        obj = self._obj([CompletionChoice(text="", finish_reason=finished.finish_reason.value)],
                        spec_stats=self.spec_stats(finished))
        return self.dump(obj, final=True)

    def usage_chunk(self, finished: Finished) -> dict:
        return self.dump(self._obj([], usage=self.usage(finished)))

    def complete(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob] | None = None) -> dict:
        obj = self._obj([CompletionChoice(text=text, logprobs=self._logprobs(logprobs),
                                          finish_reason=finished.finish_reason.value)],
                        usage=self.usage(finished), spec_stats=self.spec_stats(finished))
        return self.dump(obj, final=True)


Formatter = ChatFormatter | CompletionFormatter

"""One chunk of an OpenAI-compatible ``/v1/completions`` stream, parsed.

A stream (OpenAI Completions API, ``stream: true`` with ``stream_options.include_usage``) is SSE
lines ``data: <json>`` ending with ``data: [DONE]``. Each chunk is a ``text_completion`` object:
``choices[0]`` carries ``text`` (the new text), ``finish_reason`` (``null`` until the last
choice chunk; ``"stop"`` or ``"length"``, SGLang also ``"abort"``), optionally ``logprobs``,
``token_ids`` (vLLM/SGLang ``return_token_ids``) and ``matched_stop`` (SGLang); the usage chunk
has ``choices: []`` and ``usage: {"prompt_tokens", "completion_tokens",
"prompt_tokens_details": {"cached_tokens"}}``. Errors inside a stream come as
``{"error": {"message", "type", "code"}}`` (OpenAI, vLLM, SGLang) or, from older vLLM,
``{"object": "error", "message", "code"}``.

Logprobs, two shapes:

* OpenAI legacy completions (vLLM, SGLang): ``{"tokens": [...], "token_logprobs": [...],
  "top_logprobs": [{token: logprob}, ...]}``; tokens must be ``"token_id:<id>"`` (vLLM's
  ``return_tokens_as_token_ids``), the only form that maps back to ids exactly;
* llama-server: ``{"content": [{"id", "logprob", "top_logprobs": [{"id", "logprob"}]}]}``.

``top`` is sorted most likely first and cut to the n asked for (vLLM adds the sampled token
to the top dict when it ranks lower; the interface's top list has exactly n entries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.interface import TokenLogprob
from runtime.upstream.assembler import ProtocolError

TOKEN_ID_PREFIX = "token_id:"


class UpstreamStreamError(RuntimeError):
    """An error object the upstream sent inside the stream.

    Attributes:
        message: its message.
        status: its ``code`` when that is an HTTP status (int), else ``None``.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class CompletionChunk:
    """What one chunk says (module docstring).

    Attributes:
        text: new completion text (``""`` for the usage chunk).
        token_ids: the chunk's token ids (from ``token_ids`` or the logprobs); ``None`` when the
            upstream sent neither.
        logprobs: one entry per token when logprobs were asked for, else ``None``.
        finish_reason: ``None`` until the last choice chunk.
        matched_stop: the stop string that ended the reply, when the server says (SGLang).
        usage: the ``usage`` object when the chunk carries one.
    """

    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    matched_stop: str | None = None
    usage: dict | None = None


def _token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        try:
            return int(token[len(TOKEN_ID_PREFIX):])
        except ValueError:
            pass
    raise ProtocolError(f"logprobs token {token!r} is not 'token_id:<id>' (the server must support "
                        "vLLM's return_tokens_as_token_ids; else set SPARKGATE_UPSTREAM_LOGPROBS=false)")


def _top(pairs: list[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    pairs.sort(key=lambda p: -p[1])
    return pairs[:n]


def parse_logprobs(obj: Any, num_top: int) -> tuple[list[int], list[TokenLogprob]]:
    """``(token ids, entries)`` of a chunk's ``logprobs`` object (either shape, module docstring).

    Raises:
        ProtocolError: neither shape, or tokens that are not ids.
    """
    if not isinstance(obj, dict):
        raise ProtocolError("logprobs is not an object")
    entries: list[TokenLogprob] = []
    if isinstance(obj.get("content"), list):  # llama-server
        for item in obj["content"]:
            try:
                top = [(int(t["id"]), float(t["logprob"])) for t in item.get("top_logprobs") or ()]
                entries.append(TokenLogprob(int(item["id"]), float(item["logprob"]), _top(top, num_top)))
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"malformed logprobs content entry: {exc}") from None
        return [e.token_id for e in entries], entries
    tokens, lps, tops = obj.get("tokens"), obj.get("token_logprobs"), obj.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(lps, list) or len(tokens) != len(lps):
        raise ProtocolError("logprobs lacks aligned tokens and token_logprobs")
    tops = tops if isinstance(tops, list) else [None] * len(tokens)
    for token, lp, top in zip(tokens, lps, tops):
        pairs = [(_token_id(t), float(v)) for t, v in top.items()] if isinstance(top, dict) else []
        entries.append(TokenLogprob(_token_id(token), float(lp if lp is not None else float("-inf")),
                                    _top(pairs, num_top)))
    return [e.token_id for e in entries], entries


def _error(obj: dict) -> UpstreamStreamError:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        message, code = str(err.get("message", err)), err.get("code")
    else:
        message, code = str(err), None
    return UpstreamStreamError(message, code if isinstance(code, int) else None)


def parse_chunk(obj: Any, num_top: int | None) -> CompletionChunk:
    """Parse one decoded ``data:`` payload; ``num_top``: the request's ``logprobs`` (``None``:
    logprobs not asked for, any sent are ignored).

    Raises:
        UpstreamStreamError: the payload is an error object.
        ProtocolError: not a completions chunk.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(f"chunk is a {type(obj).__name__}, not an object")
    if "error" in obj or obj.get("object") == "error":
        raise _error(obj)
    usage = obj.get("usage")
    chunk = CompletionChunk(usage=usage if isinstance(usage, dict) else None)
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise ProtocolError("chunk has no choices list")
    if not choices:
        return chunk
    choice = choices[0]
    if not isinstance(choice, dict):
        raise ProtocolError("choices[0] is not an object")
    text = choice.get("text")
    if text is None:
        text = ""
    elif not isinstance(text, str):
        raise ProtocolError("choices[0].text is not a string")
    chunk.text = text
    ids = choice.get("token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ProtocolError("choices[0].token_ids is not a list of integers")
        chunk.token_ids = ids
    if num_top is not None and choice.get("logprobs") is not None:
        chunk.token_ids, chunk.logprobs = parse_logprobs(choice["logprobs"], num_top)
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise ProtocolError(f"choices[0].finish_reason {finish!r} is not a string")
    chunk.finish_reason = finish
    matched = choice.get("matched_stop")
    chunk.matched_stop = matched if isinstance(matched, str) else None
    return chunk

"""OpenAI ``logprobs`` objects from the runtime's :class:`TokenLogprob` entries.

Values are the target model's raw logprobs (``log_softmax`` of its logits before
temperature/top-k/top-p, see :mod:`runtime.engine.logprobs`), one entry per completion
token, EOS included when it ended the reply. Token strings come from the backend
(:meth:`runtime.interface.Backend.token_bytes`), never from engine internals:

* ``bytes``: the token's exact UTF-8 bytes as a list of ints. A multibyte
  character split over tokens gives each token its share of the bytes; joining the
  ``bytes`` of consecutive tokens gives the text (OpenAI's stated use of the field).
* ``token``: those bytes decoded as UTF-8, with bytes that are not a complete
  character written as ``\\xNN`` escapes (so ``token`` is always valid JSON text).
  Special tokens show their literal text (``<|im_end|>``) although they add
  nothing to ``content``.

Streaming rule: a content chunk lists exactly the tokens the engine kept in that
step (:class:`runtime.interface.TextDelta`). Its text may lag behind those tokens
(a partial character or a possible stop-string prefix is held back), so a chunk can
carry ``"content": ""`` with logprobs; joined over the stream, the lists equal the
non-streamed response's.

Shapes: chat (OpenAI "Chat", ``choices[i].logprobs``) ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal":
null}``; legacy completions (``/v1/completions`` ``logprobs: n``) ``{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, where each
``top_logprobs`` dict holds the n most likely tokens plus the chosen one (so up to
n + 1 entries, as OpenAI documents; equal strings keep the higher logprob) and
``text_offset`` counts characters from the start of the completion in the
concatenated token texts (a token that starts inside a multibyte character gets
that character's offset).
"""

from __future__ import annotations

import codecs
from typing import Callable, Sequence

from runtime.interface import TokenLogprob

TokenBytesFn = Callable[[Sequence[int]], list[bytes]]


def token_text(raw: bytes) -> str:
    """A token's display string: UTF-8, incomplete byte sequences as ``\\xNN``."""
    return raw.decode("utf-8", errors="backslashreplace")


class LogprobsBuilder:
    """Renders one request's logprobs, chunk by chunk (keeps ``text_offset`` state).

    Args:
        token_bytes: the backend's :meth:`~runtime.interface.Backend.token_bytes`.
        num_top: alternatives requested per token (chat ``top_logprobs``, legacy
            ``logprobs``); the engine returns exactly that many.
    """

    def __init__(self, token_bytes: TokenBytesFn, num_top: int):
        self._token_bytes = token_bytes
        self.num_top = num_top
        self._chars = 0  # characters of the token texts rendered so far (legacy text_offset)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def fresh(self) -> LogprobsBuilder:
        """A builder with the same token lookup and ``num_top`` and no state (another choice)."""
        return LogprobsBuilder(self._token_bytes, self.num_top)

    def _lookup(self, entries: Sequence[TokenLogprob]) -> dict[int, bytes]:
        ids = sorted({e.token_id for e in entries} | {t for e in entries for t, _ in e.top})
        return dict(zip(ids, self._token_bytes(ids)))

    def chat(self, entries: Sequence[TokenLogprob]) -> dict:
        """``choices[i].logprobs`` of a chat response or chunk."""
        raw = self._lookup(entries)

        def item(tid: int, logprob: float) -> dict:
            return {"token": token_text(raw[tid]), "logprob": logprob, "bytes": list(raw[tid])}

        content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                   for e in entries]
        return {"content": content, "refusal": None}

    def completion(self, entries: Sequence[TokenLogprob]) -> dict:
        """``choices[i].logprobs`` of a legacy completion (offsets continue across chunks)."""
        raw = self._lookup(entries)
        offsets = []
        for e in entries:
            offsets.append(self._chars)
            self._chars += len(self._utf8.decode(raw[e.token_id]))
        return {
            "tokens": [token_text(raw[e.token_id]) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [self._top_dict(e, raw) for e in entries],
            "text_offset": offsets,
        }

    @staticmethod
    def _top_dict(e: TokenLogprob, raw: dict[int, bytes]) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, lp in sorted([*e.top, (e.token_id, e.logprob)], key=lambda x: -x[1]):
            out.setdefault(token_text(raw[t]), lp)
        return out

"""Upstream stream chunks → :class:`runtime.interface.TextDelta` events, the interface's text
contract kept: a stop string is never returned, even when the server streamed a prefix of it
before it matched (SGLang trims the match only from its final chunk), and an incomplete last
UTF-8 character is never rendered as U+FFFD.

Shared by the SGLang client (:mod:`runtime.sglang.client`) and the OpenAI-compatible one
(:mod:`runtime.upstream.client`).
"""

from __future__ import annotations

from typing import Sequence

from runtime.engine.detokenizer import drop_incomplete_tail
from runtime.interface import TextDelta


class ProtocolError(ValueError):
    """An upstream chunk does not follow the server's streaming protocol."""


class StreamAssembler:
    """Turns an upstream's stream chunks into text deltas (cumulative or incremental chunks),
    holding back text that could still become a stop string.

    SGLang's native ``/generate`` (cumulative by default) and every OpenAI-compatible
    ``/v1/completions`` stream (incremental) feed it; the notes below are SGLang's, an
    OpenAI-compatible server that holds back stop-string prefixes itself (vLLM) simply never
    hits them.

    SGLang's detokenizer holds back a trailing U+FFFD while streaming but renders an
    incomplete last character as U+FFFD in the final chunk (a ``max_tokens`` cut inside
    an emoji). As in the embedded engine (:mod:`runtime.engine.detokenizer`), that
    U+FFFD is dropped when the bytes of the last ``output_ids`` end in an incomplete
    UTF-8 character (needs ``tokenizer`` and ``output_ids``); a complete U+FFFD is kept.

    Args:
        stop: the request's stop strings.
        incremental: chunk mode; ``None`` → detect (the first chunk reads the same in
            both modes; a later one is cumulative when ``len(output_ids) ==
            completion_tokens``, incremental when it equals the new-token count, and
            otherwise cumulative iff its text extends the text so far).
        tokenizer: the model's tokenizer, for the bytes of the last tokens (``None``:
            the final text is released as SGLang sent it).
    """

    TAIL_IDS = 8  # last tokens whose bytes decide whether the final character is incomplete

    def __init__(self, stop: Sequence[str] = (), incremental: bool | None = None, tokenizer=None) -> None:
        self.stop = tuple(s for s in stop if s)
        self.incremental = incremental
        self.tokenizer = tokenizer
        self.text = ""
        self.ids: list[int] = []
        self.completion_tokens = 0
        self.chunks = 0
        self.sent_chars = 0
        self.sent_tokens = 0
        self.sent_ids = 0

    def _is_incremental(self, text: str, ids: list | None, completion_tokens: int) -> bool:
        if self.incremental is not None:
            return self.incremental
        if self.chunks == 0:
            return False  # identical either way; decide on a later chunk
        new = completion_tokens - self.completion_tokens
        decided: bool | None = None
        if ids is not None:
            if len(ids) == completion_tokens and len(ids) != new:
                decided = False
            elif len(ids) == new and len(ids) != completion_tokens:
                decided = True
        if decided is None:
            decided = not (text.startswith(self.text) and len(text) >= len(self.text))
        self.incremental = decided
        return decided

    def feed(self, text: str, ids: list | None, completion_tokens: int) -> None:
        """Add one chunk's ``text``, ``output_ids`` and ``meta_info.completion_tokens``.

        Raises:
            ProtocolError: a cumulative chunk that does not extend the text so far.
        """
        if self._is_incremental(text, ids, completion_tokens):
            self.text += text
            if ids:
                self.ids.extend(ids)
        else:
            if not text.startswith(self.text):
                raise ProtocolError("cumulative chunk text does not extend the previous text")
            self.text = text
            if ids is not None:
                self.ids = list(ids)
        self.completion_tokens = max(self.completion_tokens, completion_tokens)
        self.chunks += 1

    def _first_stop(self, matched: str | None) -> int | None:
        stops = self.stop + ((matched,) if matched else ())
        if not stops:
            return None
        longest = max(len(s) for s in stops)
        start = max(0, self.sent_chars - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in stops) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, stops: Sequence[str]) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop."""
        best = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def release(self, final: bool = False, matched: str | None = None) -> TextDelta | None:
        """The next delta, or ``None`` when nothing can be released yet.

        With ``final`` everything left is released, cut at the first stop string or
        ``matched`` (the stop string SGLang reports in ``finish_reason.matched``). When
        ``matched`` is no longer in the text, SGLang trimmed it but kept the part it had
        already streamed: that trailing prefix of ``matched`` is dropped too; without a
        stop, so is the U+FFFD of an incomplete last character (see the class docstring).
        """
        end = len(self.text)
        cut = self._first_stop(matched if final else None)
        if cut is not None:
            end = cut
        elif not final:
            end -= self._holdback(self.stop)
        elif matched:
            end -= self._holdback((matched,))
        elif self.tokenizer is not None and self.ids:
            end = len(drop_incomplete_tail(self.text, self.tokenizer, self.ids[-self.TAIL_IDS:]))
        end = max(end, self.sent_chars)
        text = self.text[self.sent_chars:end]
        if not text and not final:
            return None
        self.sent_chars = end
        delta = TextDelta(text, self.completion_tokens - self.sent_tokens, self.ids[self.sent_ids:])
        self.sent_tokens = self.completion_tokens
        self.sent_ids = len(self.ids)
        return delta if (text or delta.num_tokens) else None

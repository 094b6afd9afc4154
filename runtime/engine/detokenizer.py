"""Per-request incremental detokenization with EOS / stop-string / max_tokens handling.

A speculative round may accept several tokens at once, so :meth:`Detokenizer.append`
takes k ≥ 1 token ids and processes them strictly in order; nothing after the
token that ends the request is decoded, emitted or counted.

Text decoding uses ``tokenizers.decoders.DecodeStream`` (the library's own
streaming decoder): it re-decodes only a short window of recent tokens and holds
a token back while the window's text ends in U+FFFD (an incomplete UTF-8
sequence, e.g. an emoji split over two byte-level BPE tokens), so each step costs
O(k) and never emits a broken character. Decoding starts at the first completion
token: SmolLM2's byte-level BPE decoder is context-free, so the joined deltas are
exactly ``tokenizer.decode(kept_ids, skip_special_tokens=True)`` (cut at a stop
string), except at the very end: **an incomplete trailing UTF-8 character is dropped,
never rendered as U+FFFD**, whatever ended the request (``max_tokens`` inside an emoji,
EOS right after half a character, :meth:`Detokenizer.finish`). The text is then the
longest complete-character prefix of the full decode. Its tokens still count
(``num_tokens_kept``, ``token_ids_kept``; their logprobs keep the raw bytes, see
:func:`token_bytes`). A U+FFFD the model generated as a complete character (bytes
``EF BF BD``), or invalid bytes followed by more text, is kept as ``decode`` renders it.
Special tokens other than EOS produce no text.

Conventions (OpenAI chat-completions, as served by vLLM):

* **EOS** (``eos_token_id``, unless ``params.ignore_eos``): finish ``stop``. The
  EOS token produces no text but *is* a completion token (vLLM counts it in
  ``usage.completion_tokens``), so it is included in ``num_tokens_kept`` and
  ``token_ids_kept``; tokens after it are dropped.
* **Stop token ids** (``params.stop_token_ids``, vLLM's): end the request like EOS (finish
  ``stop``; the token counts, adds no text; also with ``ignore_eos``).
* **min_tokens** (vLLM's): stop strings are matched only once more than ``min_tokens``
  tokens were generated (vLLM's detokenizer rule); the sampler never draws EOS or a stop
  token id before that (:mod:`runtime.engine.logits_processors`).
* **Stop strings** (``params.stop``, empty strings ignored): matched on the
  decoded text across token boundaries; the earliest match wins; the stop text
  and everything after it is never returned. The token that completed the match
  is kept and counted (its text may extend past the stop and is cut); later
  tokens are dropped. Finish ``stop``. A text tail that could be the start of a
  stop string is held back until disambiguated, and released when the request
  ends for any other reason.
* **max_tokens**: finish ``length`` when the count reaches the cap (EOS or a stop
  string completed by that same token take precedence, as in vLLM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from runtime.interface import FinishReason, SamplingParams


@dataclass
class StepResult:
    """Outcome of one :meth:`Detokenizer.append` (or :meth:`Detokenizer.finish`).

    Attributes:
        text: newly released completion text (may be ``""`` while a partial UTF-8
            character or a possible stop-string prefix is held back).
        num_tokens_kept: how many of the appended tokens count as completion
            tokens (a prefix of the input; EOS included when it ended the request).
        finish_reason: set when this step ended the request, else ``None``.
        token_ids_kept: ``token_ids[:num_tokens_kept]``.
    """

    text: str
    num_tokens_kept: int
    finish_reason: FinishReason | None
    token_ids_kept: list[int] = field(default_factory=list)


class Detokenizer:
    """Incremental detokenizer and stop checker of one request.

    Args:
        tokenizer: a ``transformers`` fast tokenizer (its ``backend_tokenizer`` is
            used) or a ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt (only its length is kept, as ``prompt_tokens``;
            decoding starts at the completion, see the module docstring).
        params: the request's sampling parameters (``stop``, ``ignore_eos``,
            ``stop_token_ids``, ``min_tokens``).
        eos_token_id: the id that ends generation (SmolLM2: 2, ``<|im_end|>``).
        max_tokens: completion-token cap (≥ 1), ``None`` for no cap (the engine then
            ends the request itself via :meth:`finish`).

    Raises:
        ValueError: ``max_tokens < 1``.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_id: int,
        max_tokens: int | None,
    ):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._tok: Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)
        self._eos = None if params.ignore_eos else int(eos_token_id)
        self._stop_ids = frozenset(int(t) for t in params.stop_token_ids)
        self._min_tokens = int(params.min_tokens)
        self._stops = tuple(s for s in params.stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self.max_tokens = max_tokens
        self.prompt_tokens = len(prompt_token_ids)
        self.num_tokens = 0  # completion tokens counted so far
        self.finish_reason: FinishReason | None = None
        self._pending: list[int] = []  # fed to the stream, text not yet released by it
        self._held = ""  # decoded text held back as a possible stop-string prefix

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_left(self) -> int | None:
        """Completion tokens still allowed before ``max_tokens`` (``None``: no cap)."""
        return None if self.max_tokens is None else self.max_tokens - self.num_tokens

    def append(self, token_ids: Sequence[int]) -> StepResult:
        """Consume newly generated tokens, in order, and release what is final.

        Args:
            token_ids: k ≥ 0 new token ids (e.g. the accepted tokens of a round).

        Returns:
            A :class:`StepResult`; when ``finish_reason`` is set, all remaining
            held text has been released and the detokenizer is closed.

        Raises:
            RuntimeError: the request already finished.
        """
        if self.finish_reason is not None:
            raise RuntimeError(f"append() after the request finished ({self.finish_reason.value})")
        kept: list[int] = []
        buf = self._held
        reason: FinishReason | None = None
        cut_by_stop = False
        for tid in token_ids:
            tid = int(tid)
            kept.append(tid)
            self.num_tokens += 1
            if tid == self._eos or tid in self._stop_ids:
                reason = FinishReason.STOP
                break
            chunk = self._stream.step(self._tok, tid)
            if chunk is None:
                self._pending.append(tid)
            else:
                self._pending.clear()
                start = max(0, len(buf) - self._max_stop + 1)
                buf += chunk
                cut = self._find_stop(buf, start) if self.num_tokens > self._min_tokens else None
                if cut is not None:
                    buf = buf[:cut]
                    reason, cut_by_stop = FinishReason.STOP, True
                    break
            if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
                reason = FinishReason.LENGTH
                break
        if reason is None:
            hold = self._stop_prefix_len(buf)
            self._held = buf[len(buf) - hold :]
            return StepResult(buf[: len(buf) - hold], len(kept), None, kept)
        if not cut_by_stop:
            buf += self._decode_pending()
        self._close(reason)
        return StepResult(buf, len(kept), reason, kept)

    def finish(self, reason: FinishReason = FinishReason.LENGTH) -> StepResult:
        """End the request from outside (context limit, abort, error) and release
        all held-back text: a pending stop-string prefix, and the complete characters
        of tokens the stream still holds. An incomplete trailing UTF-8 character is
        dropped (never U+FFFD); its tokens were already counted.

        Idempotent: after the request finished, returns an empty result carrying the
        original finish reason.
        """
        if self.finish_reason is not None:
            return StepResult("", 0, self.finish_reason, [])
        text = self._held + self._decode_pending()
        self._close(reason)
        return StepResult(text, 0, reason, [])

    flush = finish  # alias: end-of-request release of held-back text

    # ------------------------------------------------------------------ helpers

    def _close(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self._held = ""
        self._pending = []

    def _decode_pending(self) -> str:
        """Text of tokens the stream still holds, at the end of the request, without
        an incomplete trailing character (:func:`drop_incomplete_tail`).

        They start at a character boundary (everything before was released), so
        decoding them alone equals their share of the full decode.
        """
        if not self._pending:
            return ""
        text = self._tok.decode(self._pending, skip_special_tokens=True)
        return drop_incomplete_tail(text, self._tok, self._pending)

    def _find_stop(self, text: str, start: int) -> int | None:
        """Index of the earliest stop-string occurrence in ``text[start:]``, or None."""
        best = None
        for s in self._stops:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best):
                best = i
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


# ------------------------------------------------------------------ token bytes

def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's char → byte table (the inverse of its ``bytes_to_unicode``:
    printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100 onwards)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer, token_ids: Sequence[int]) -> list[bytes]:
    """The exact bytes each token stands for (OpenAI logprobs ``bytes``).

    Byte-level BPE (SmolLM2, GPT-2 family): the token's vocabulary string mapped
    back through the byte table, so a token holding half of a multibyte character
    gives those raw bytes (``tokenizer.decode([id])`` would give U+FFFD). Added /
    special tokens give their literal content (``b"<|im_end|>"``). Other decoders:
    ``decode([id])`` encoded as UTF-8.

    Args:
        tokenizer: a ``transformers`` fast tokenizer or a ``tokenizers.Tokenizer``.
        token_ids: ids to look up.
    """
    tok: Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
    added = tok.get_added_tokens_decoder()
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    out = []
    for tid in token_ids:
        tid = int(tid)
        if tid in added:
            out.append(added[tid].content.encode())
            continue
        piece = tok.id_to_token(tid) if byte_level else None
        if piece is not None and all(c in _BYTE_DECODER for c in piece):
            out.append(bytes(_BYTE_DECODER[c] for c in piece))
        else:
            out.append(tok.decode([tid], skip_special_tokens=False).encode())
    return out


def text_bytes(tokenizer, token_ids: Sequence[int]) -> bytes:
    """The bytes ``tokenizer.decode(token_ids, skip_special_tokens=True)`` turns into text:
    :func:`token_bytes` of the non-special tokens, joined (exact for byte-level BPE)."""
    tok: Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return b"".join(token_bytes(tok, [i for i in map(int, token_ids) if i not in special]))


# The allowed second byte after the lead bytes that restrict it (Unicode Table 3-7);
# other lead bytes take any continuation byte 80..BF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def incomplete_utf8_tail(data: bytes) -> int:
    """How many trailing bytes of ``data`` (0-3) start a UTF-8 character without finishing it.

    Nonzero only when the last bytes are a proper prefix of a well-formed sequence
    (Unicode Table 3-7), e.g. 2 for ``b"\\xf0\\x9f"`` (half an emoji). 0 when ``data``
    ends with a complete character, with ASCII, or with bytes no continuation could
    make valid (those are invalid, not incomplete).
    """
    for n in range(1, min(3, len(data)) + 1):
        lead = data[-n]
        if lead < 0x80:
            return 0
        if lead < 0xC0:  # continuation byte: the lead is further back
            continue
        need = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 0
        lo, hi = _SECOND_BYTE.get(lead, (0x80, 0xBF))
        return n if n < need and (n == 1 or lo <= data[-n + 1] <= hi) else 0
    return 0


def drop_incomplete_tail(text: str, tokenizer, token_ids: Sequence[int]) -> str:
    """``text`` without the U+FFFD that an incomplete trailing UTF-8 character renders as.

    Args:
        text: a decode that ends with the decode of ``token_ids``
            (``skip_special_tokens=True``), e.g. a whole reply.
        tokenizer: a ``transformers`` fast tokenizer or a ``tokenizers.Tokenizer``.
        token_ids: the last generated tokens (enough for 4 bytes of text; more are fine).

    Returns:
        ``text[:-1]`` when the tokens' bytes (:func:`text_bytes`) end in an incomplete
        character (which a lossy UTF-8 decode renders as exactly one U+FFFD), else ``text``
        — a U+FFFD the model generated as a complete character is kept. Only byte-level
        BPE gives a token's partial bytes; with other decoders the U+FFFD stays.
    """
    if text.endswith("\ufffd") and incomplete_utf8_tail(text_bytes(tokenizer, token_ids)):
        return text[:-1]
    return text


def template_renders_tools(tokenizer) -> bool:
    """Whether a Hugging Face tokenizer's chat template has a tool section of its own (its
    Jinja source reads the ``tools`` variable, as Qwen2.5's, Llama 3.1's and Hermes 2 Pro's
    do; SmolLM2's plain ChatML does not)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or a "tool_use" one
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


class GatewayTokenization:
    """The :class:`~runtime.interface.Backend` methods that run on the gateway side, over the
    backend's Hugging Face tokenizer ``self._tokenizer``: the ChatML prompt, plain encoding
    (no special tokens added) and each token's bytes (:func:`token_bytes`)."""

    _tokenizer: object

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        extra = {} if tools is None else {"tools": list(tools)}
        text = self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)
        return self._tokenizer.encode(text, add_special_tokens=False)

    @property
    def chat_template_tools(self) -> bool:
        """:attr:`runtime.interface.BackendInfo.chat_template_tools` (``False`` before the
        tokenizer is loaded)."""
        tok = getattr(self, "_tokenizer", None)
        return tok is not None and template_renders_tools(tok)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        return token_bytes(self._tokenizer, token_ids)


def load_tokenizer(path: str | None):
    """``transformers.AutoTokenizer`` of ``path`` (a local dir or hub id; ``None`` → the
    converted embedded model, :func:`runtime.models.loader.ensure_converted`): the tokenizer a
    backend serving remotely templates and counts with (:class:`GatewayTokenization`)."""
    from transformers import AutoTokenizer

    if path is None:
        from runtime.models.loader import ensure_converted

        path = str(ensure_converted())
    return AutoTokenizer.from_pretrained(str(path))

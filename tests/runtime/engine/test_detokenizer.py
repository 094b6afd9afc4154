"""Tests for runtime/engine/detokenizer.py with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from runtime.engine.detokenizer import Detokenizer, StepResult, incomplete_utf8_tail, token_bytes
from runtime.interface import FinishReason, SamplingParams

EOS = 2
MULTIBYTE = [
    "Ærøskøbing naïve Zürich — Ελληνικά Привет, café crème brûlée.",
    "日本語のテキスト 中文字符 한국어",
    "Party 🎉🚀👍🏽 ok 🇫🇷 done",
]
WHITESPACE = "  Leading spaces\n\nTwo newlines\ttab  \n   indented\r\nwindows  trailing   "


def make(tokenizer, params=None, max_tokens=None, prompt=(1, 2, 3)):
    return Detokenizer(tokenizer, list(prompt), params or SamplingParams(), EOS, max_tokens)


def feed(det: Detokenizer, ids: list[int], chunk: int) -> tuple[list[StepResult], str]:
    """Feed ``ids`` in chunks until the request finishes; returns results and joined text."""
    results = []
    for i in range(0, len(ids), chunk):
        r = det.append(ids[i : i + chunk])
        results.append(r)
        if r.finish_reason is not None:
            break
    else:
        results.append(det.finish(FinishReason.LENGTH))
    return results, "".join(r.text for r in results)


def full(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_test_strings_really_split_utf8_characters(tokenizer):
    for s in MULTIBYTE:
        ids = tokenizer.encode(s)
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids), s
        assert full(tokenizer, ids) == s


@pytest.mark.parametrize("chunk", [1, 3, 5, 8])
@pytest.mark.parametrize("text", MULTIBYTE + [WHITESPACE])
def test_incremental_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    det = make(tokenizer)
    results, joined = feed(det, ids, chunk)
    assert joined == full(tokenizer, ids) == text
    for r in results:
        assert "\ufffd" not in r.text
    assert sum(r.num_tokens_kept for r in results) == len(ids)
    assert [t for r in results for t in r.token_ids_kept] == ids
    # Text flows while streaming: all of it is out before the final finish() call.
    assert results[-1].text == "" and results[-1].finish_reason is FinishReason.LENGTH


def test_partial_character_held_then_released(tokenizer):
    ids = tokenizer.encode("a 😀 b")
    det = make(tokenizer)
    outs = [det.append([i]).text for i in ids]
    # The emoji's first byte-token yields nothing; the completing token yields it whole.
    assert "" in outs and any("😀" in o for o in outs)
    assert "".join(outs) == "a 😀 b"


def _find_spanning_stop(tokenizer, text):
    """A stop string made of the end of token i and the start of token i+1."""
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    for i in range(1, len(ids) - 2):
        a, b = pieces[i], pieces[i + 1]
        if len(a.strip()) >= 2 and len(b.strip()) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            prefix = "".join(pieces[:i]) + a[:-2]
            if text.find(stop) == len(prefix):  # first occurrence is at the boundary
                return ids, i + 1, stop
    raise AssertionError("no spanning stop found")


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_stop_string_spanning_two_tokens(tokenizer, chunk):
    text = "The quick brown fox jumps over the lazy dog near the riverbank today."
    ids, last_idx, stop = _find_spanning_stop(tokenizer, text)
    det = make(tokenizer, SamplingParams(stop=(stop,)))
    results, joined = feed(det, ids, chunk)
    assert joined == text[: text.find(stop)]
    assert stop not in joined
    assert results[-1].finish_reason is FinishReason.STOP
    kept = [t for r in results for t in r.token_ids_kept]
    assert kept == ids[: last_idx + 1]  # the completing token counts, nothing after
    assert sum(r.num_tokens_kept for r in results) == last_idx + 1 == det.num_tokens
    with pytest.raises(RuntimeError):
        det.append([ids[-1]])


def test_stop_at_very_start(tokenizer):
    ids = tokenizer.encode("Hello world, how are you")
    det = make(tokenizer, SamplingParams(stop=("Hel",)))
    r = det.append(ids)
    assert r == StepResult("", 1, FinishReason.STOP, ids[:1])


def test_earliest_of_several_stops_wins(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text)
    det = make(tokenizer, SamplingParams(stop=("delta", "eta", "gamma")))
    r = det.append(ids)
    assert r.text == "alpha b" and r.finish_reason is FinishReason.STOP
    # "eta" is completed by the token containing "beta": tokens after it are dropped.
    n = next(i for i in range(1, len(ids) + 1) if "eta" in full(tokenizer, ids[:i]))
    assert r.num_tokens_kept == n


def test_held_back_stop_prefix_released(tokenizer):
    ids = tokenizer.encode("one two three four")
    two_end = next(i for i in range(1, len(ids) + 1) if full(tokenizer, ids[:i]).endswith(" two"))
    det = make(tokenizer, SamplingParams(stop=(" two!",)))
    r1 = det.append(ids[:two_end])
    assert r1.text == "one" and r1.finish_reason is None  # " two" could start " two!"
    r2 = det.append(ids[two_end:])
    assert r2.text == " two three four" and r2.finish_reason is None
    assert det.finish().text == ""


def test_held_back_prefix_released_at_length_and_finish(tokenizer):
    ids = tokenizer.encode("one two")
    det = make(tokenizer, SamplingParams(stop=(" two!",)), max_tokens=len(ids))
    r = det.append(ids)
    assert r.text == "one two" and r.finish_reason is FinishReason.LENGTH
    det2 = make(tokenizer, SamplingParams(stop=(" two!",)))
    assert det2.append(ids).text == "one"
    fin = det2.finish(FinishReason.LENGTH)
    assert fin == StepResult(" two", 0, FinishReason.LENGTH, [])
    assert det2.finish() == StepResult("", 0, FinishReason.LENGTH, [])  # idempotent


def test_eos_inside_chunk_of_eight(tokenizer):
    ids = tokenizer.encode("Sure, here it is and more text after")
    chunk = ids[:3] + [EOS] + ids[3:7]
    assert len(chunk) == 8
    det = make(tokenizer)
    r = det.append(chunk)
    assert r.finish_reason is FinishReason.STOP
    assert r.text == full(tokenizer, ids[:3])
    assert r.num_tokens_kept == 4 and r.token_ids_kept == ids[:3] + [EOS]  # EOS counted
    assert det.num_tokens == 4


def test_eos_releases_held_text_and_ignore_eos(tokenizer):
    ids = tokenizer.encode("go stop")
    det = make(tokenizer, SamplingParams(stop=(" stop now",)))
    r = det.append(ids + [EOS, 11])
    assert r.text == "go stop" and r.num_tokens_kept == len(ids) + 1
    det = make(tokenizer, SamplingParams(ignore_eos=True))
    r = det.append(ids + [EOS] + ids)
    assert r.finish_reason is None and r.num_tokens_kept == 2 * len(ids) + 1
    assert r.text == "go stopgo stop"


def test_max_tokens_in_middle_of_chunk(tokenizer):
    ids = tokenizer.encode("Counting one two three four five six seven eight nine ten")
    det = make(tokenizer, max_tokens=5)
    r1 = det.append(ids[:3])
    assert r1.finish_reason is None and det.tokens_left == 2
    r2 = det.append(ids[3:11])
    assert r2.num_tokens_kept == 2 and r2.token_ids_kept == ids[3:5]
    assert r2.finish_reason is FinishReason.LENGTH
    assert r1.text + r2.text == full(tokenizer, ids[:5])
    assert det.num_tokens == 5


def complete_prefix(tokenizer, text: str, ids: list[int]) -> str:
    """The longest complete-character prefix of ``text`` covered by the bytes of ``ids``
    (Python's own UTF-8 codec drops the incomplete tail)."""
    raw = b"".join(token_bytes(tokenizer, ids))
    assert text.encode().startswith(raw)
    return raw.decode("utf-8", errors="ignore")


CUT_TEXTS = ["👋🎉 你好世界", "x😀", "🇫🇷👍🏽 ok", "日本語 한국어 é"]


@pytest.mark.parametrize("text", CUT_TEXTS)
def test_cut_at_every_token_drops_the_incomplete_character(tokenizer, text):
    """max_tokens, EOS and finish() at every prefix length: no U+FFFD, the longest
    complete-character prefix, and every generated token still counted."""
    ids = tokenizer.encode(text)
    cuts_inside = 0
    for n in range(1, len(ids) + 1):
        want = complete_prefix(tokenizer, text, ids[:n])
        cuts_inside += "\ufffd" in full(tokenizer, ids[:n])
        for chunk in (1, 3, len(ids)):  # max_tokens = n, fed in rounds of `chunk` tokens
            results, got = feed(make(tokenizer, max_tokens=n), ids, chunk)
            assert got == want and "\ufffd" not in got
            assert results[-1].finish_reason is FinishReason.LENGTH
            assert sum(r.num_tokens_kept for r in results) == n
            assert [t for r in results for t in r.token_ids_kept] == ids[:n]
        det = make(tokenizer)  # EOS right after the prefix
        r = det.append(ids[:n] + [EOS])
        assert (r.text, r.num_tokens_kept, r.finish_reason) == (want, n + 1, FinishReason.STOP)
        det = make(tokenizer)  # ended from outside (context limit)
        r1 = det.append(ids[:n])
        assert r1.text + det.finish(FinishReason.LENGTH).text == want and r1.num_tokens_kept == n
    assert cuts_inside >= 2  # the strings really get cut inside characters


def test_model_generated_replacement_character_is_kept(tokenizer):
    ids = tokenizer.encode("a\ufffd")  # U+FFFD as a complete character: bytes EF BF BD
    assert b"".join(token_bytes(tokenizer, ids)) == "a\ufffd".encode()
    for n in range(1, len(ids) + 1):
        r = make(tokenizer, max_tokens=n).append(ids)
        assert r.text == complete_prefix(tokenizer, "a\ufffd", ids[:n])
    assert make(tokenizer).append(ids + [EOS]).text == "a\ufffd"
    # invalid bytes followed by more text stay as decode renders them
    half = tokenizer.encode("😀")[:1]
    a = tokenizer.encode("a")
    assert make(tokenizer, max_tokens=2).append(half + a).text == full(tokenizer, half + a) == "\ufffda"


def _utf8_proper_prefixes() -> set[bytes]:
    out = set()
    for cp in range(0x80, 0x110000):
        if not 0xD800 <= cp <= 0xDFFF:
            enc = chr(cp).encode()
            out.update(enc[:k] for k in range(1, len(enc)))
    return out


def test_incomplete_utf8_tail_matches_the_unicode_definition():
    prefixes = _utf8_proper_prefixes()

    def want(data: bytes) -> int:
        return next((n for n in (1, 2, 3) if len(data) >= n and data[-n:] in prefixes), 0)

    cases = [bytes([a]) for a in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    cases += [b"", b"a\xf0\x9f\x91", b"\xf0\x9f\x91\x8b", b"\xef\xbf\xbd", b"\xed\x9f\xbf", b"\xed\xa0",
              b"\xf4\x8f\xbf", b"\xf4\x90\x80", b"\xe0\x9f", b"\x80\x80\x80"]
    assert [incomplete_utf8_tail(c) for c in cases] == [want(c) for c in cases]
    named = (b"\xf0\x9f", b"\xe4\xbd", b"\xc3", b"\xed\xa0", b"\xef\xbf\xbd")  # half 👋, half 你, half é, surrogate, U+FFFD
    assert [incomplete_utf8_tail(c) for c in named] == [2, 2, 1, 0, 0]


def test_stop_and_eos_take_precedence_over_length(tokenizer):
    ids = tokenizer.encode("abc def")
    det = make(tokenizer, max_tokens=len(ids) + 1)
    assert det.append(ids + [EOS]).finish_reason is FinishReason.STOP
    det = make(tokenizer, SamplingParams(stop=("def",)), max_tokens=len(ids))
    r = det.append(ids)
    assert r.finish_reason is FinishReason.STOP and r.text == "abc "


def test_special_tokens_produce_no_text(tokenizer):
    ids = tokenizer.encode("hi there")
    det = make(tokenizer)
    r = det.append([ids[0], 1, 0] + ids[1:])
    assert r.text == "hi there" and r.num_tokens_kept == len(ids) + 2


def test_invalid_max_tokens(tokenizer):
    with pytest.raises(ValueError):
        make(tokenizer, max_tokens=0)

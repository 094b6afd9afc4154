"""runtime/engine/logits_processors.py, min-p in runtime/engine/sampler.py and the stop rules
of runtime/engine/detokenizer.py, against hand computations; and, with a synthetic model,
that speculative verification with the processors applied per verified position samples
the processed target's law exactly (chi-square, with the power to catch the per-row bug).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from runtime.engine.detokenizer import Detokenizer
from runtime.engine.logits_processors import RequestProcessors, apply_processors, check_params
from runtime.engine.sampler import SamplingBatch, warp_probs
from runtime.interface import FinishReason, SamplingParams
from runtime.speculation.verifier import spec_round

EOS = 2
NEG = -math.inf


def procs(prompt=(0,), eos=EOS, **kw) -> RequestProcessors:
    p = RequestProcessors.of(SamplingParams(**kw), list(prompt), eos)
    assert p is not None
    return p


def test_no_parameters_no_processors_and_no_copy():
    assert RequestProcessors.of(SamplingParams(temperature=0.5, top_k=3, min_p=0.2, stop_token_ids=(4,)), [1], EOS) is None
    x = torch.randn(3, 8)
    assert apply_processors(x, [None, None], [[1], [2, 3]], [[5], []]) is x


def test_logit_bias_adds_per_token_and_last_repeat_wins():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    p = procs(logit_bias=((1, 5.0), (3, -100.0), (1, 2.0)))  # id 1 twice: the last bias wins
    out = apply_processors(x, [p], [[0]], [[2]])
    assert out.tolist() == [[0.0, 3.0, 2.0, -97.0], [1.0, 3.0, 1.0, -99.0]]
    assert x.tolist() == [[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]]  # the raw logits are untouched


def test_min_tokens_suppresses_eos_and_stop_ids_by_position():
    # 2 tokens generated, min_tokens 4: rows 0 and 1 (positions 2, 3) suppress, row 2 (position 4) not
    p = procs(min_tokens=4, stop_token_ids=(5,))
    x = torch.arange(3 * 6, dtype=torch.float32).view(3, 6)
    out = apply_processors(x, [p], [[1, 1]], [[3, 3]])
    want = x.clone()
    want[:2, [EOS, 5]] = NEG
    assert torch.equal(out, want)
    # ignore_eos: EOS never ends the reply, so it is not suppressed (vLLM); stop ids still are
    p = procs(min_tokens=1, stop_token_ids=(5,), ignore_eos=True)
    out = apply_processors(torch.zeros(1, 6), [p], [[]])
    assert out[0].tolist() == [0, 0, 0, 0, 0, NEG]


def test_min_tokens_yields_to_a_row_with_nothing_else_allowed():
    """A grammar that allows only EOS: suppressing it would leave no token; the row is kept."""
    p = procs(min_tokens=3)
    x = torch.full((2, 4), NEG)
    x[:, EOS] = 1.0
    x[1, 0] = 0.5  # row 1 has another choice: EOS goes
    out = apply_processors(x, [p], [[]], [[0]])
    assert out[0].tolist() == [NEG, NEG, 1.0, NEG] and out[1].tolist() == [0.5, NEG, NEG, NEG]


def test_penalties_count_output_and_draft_prefix_per_row():
    """Hand computation, vLLM order: repetition (prompt ∪ output ∪ draft prefix), then
    frequency · count and presence over output ∪ draft prefix only."""
    prompt, output, drafts = [7], [1, 3, 1], [3, 4]
    rep, freq, pres = 2.0, 0.5, 0.25
    x = torch.tensor([[4.0, 2.0, 1.0, -1.0, 6.0, 0.5, 1.0, 3.0, -2.0]] * 3)
    out = apply_processors(x, [procs(prompt, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)],
                           [output], [drafts])
    for k in range(3):
        hist = output + drafts[:k]
        want = x[k].clone()
        for j in range(9):
            c = hist.count(j)
            v = want[j].item()
            if c or j in prompt:
                v = v / rep if v > 0 else v * rep
            want[j] = v - c * freq - (c > 0) * pres
        assert torch.allclose(out[k], want), (k, out[k], want)
    # the values, spelled out for row 2 (hist 1 3 1 3 4): token 1 → 2/2 − 2·0.5 − 0.25 = −0.25,
    # token 3 → −1·2 − 1.25 = −3.25, token 4 → 6/2 − 0.75 = 2.25, token 7 (prompt) → 1.5, token 0 → 4
    assert out[2, [1, 3, 4, 7, 0]].tolist() == [-0.25, -3.25, 2.25, 1.5, 4.0]


def test_requests_in_one_batch_get_their_own_rows():
    x = torch.zeros(5, 4)
    a, b = procs(logit_bias=((0, 1.0),)), procs(frequency_penalty=1.0)
    out = apply_processors(x, [a, None, b], [[2], [1], [3, 3]], [[1], [], [3]])
    assert out[:2, 0].tolist() == [1.0, 1.0] and out[2].tolist() == [0.0] * 4
    assert out[3].tolist() == [0, 0, 0, -2.0] and out[4].tolist() == [0, 0, 0, -3.0]
    with pytest.raises(ValueError):
        apply_processors(torch.zeros(4, 4), [a, None], [[1], [1]], [[1], []])


def test_tiny_repetition_penalty_stays_finite():
    out = apply_processors(torch.tensor([[30.0, 1.0]]), [procs(repetition_penalty=1e-40)], [[0]])
    assert torch.isfinite(out).all() and out[0, 0] > 1e29


@pytest.mark.parametrize("kw,msg", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": ((10, 1.0),)}, "logit_bias token id 10"), ({"logit_bias": ((1, 101.0),)}, "logit_bias of token 1"),
    ({"stop_token_ids": (-1,)}, "stop token id -1"), ({"frequency_penalty": math.nan}, "frequency_penalty"),
])
def test_check_params_names_the_bad_value(kw, msg):
    assert msg in check_params(SamplingParams(**kw), vocab_size=10)
    assert check_params(SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, logit_bias=((9, -100.0),),
                                       stop_token_ids=(0, 9), min_p=1.0, repetition_penalty=0.01), 10) is None


# ---------------------------------------------------------------- min-p


def test_min_p_keeps_tokens_within_the_ratio_after_temperature():
    logits = [2.0, 1.5, 0.0, -1.0, 1.9]
    t, min_p = 0.5, 0.3
    z = np.array(logits) / t
    p = np.exp(z - z.max())
    p /= p.sum()
    want = np.where(p >= min_p * p.max(), p, 0.0)
    want /= want.sum()
    got = warp_probs(torch.tensor([logits, logits]), torch.tensor([t, t]), torch.zeros(2, dtype=torch.long),
                     torch.ones(2), min_p=torch.tensor([min_p, 0.0]))
    assert np.allclose(got[0].numpy(), want, atol=1e-6) and (got[0] > 0).sum() == 3
    assert np.allclose(got[1].numpy(), p, atol=1e-6)  # min_p 0: plain softmax
    # min_p 1: only the most likely token; top-k after it sees the survivors only
    one = warp_probs(torch.tensor([logits]), torch.tensor([1.0]), torch.tensor([3]), torch.ones(1),
                     min_p=torch.tensor([1.0]))
    assert one[0].tolist() == [1.0, 0, 0, 0, 0]


def test_sampling_batch_carries_min_p_only_when_used():
    class Seq:
        def __init__(self, p):
            self.request = type("R", (), {"sampling": p})()
            self.generator = torch.Generator().manual_seed(0)
            self.num_generated = 0

    plain = SamplingBatch.of([Seq(SamplingParams()), Seq(SamplingParams(top_p=0.5))])
    assert plain.min_p is None
    mixed = SamplingBatch.of([Seq(SamplingParams()), Seq(SamplingParams(min_p=0.25))])
    assert mixed.min_p.tolist() == [0.0, 0.25]
    assert mixed.select([1]).min_p.tolist() == [0.25] and mixed.select([0]).min_p is None


# ---------------------------------------------------------------- stop rules (detokenizer)


def test_stop_token_ids_end_the_reply_like_eos(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    det = Detokenizer(tokenizer, [1], SamplingParams(stop_token_ids=(ids[2],)), EOS, None)
    r = det.append(ids)
    assert (r.finish_reason, r.num_tokens_kept, r.text) == (FinishReason.STOP, 3, "one two")
    # with ignore_eos too
    det = Detokenizer(tokenizer, [1], SamplingParams(stop_token_ids=(ids[1],), ignore_eos=True), EOS, None)
    assert det.append(ids).num_tokens_kept == 2


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("a stop b stop c", add_special_tokens=False)
    assert len(ids) == 5
    det = Detokenizer(tokenizer, [1], SamplingParams(stop=("stop",), min_tokens=2), EOS, None)
    r = det.append(ids)  # the first "stop" is token 2 (not > min_tokens): only the second ends it
    assert (r.finish_reason, r.text, r.num_tokens_kept) == (FinishReason.STOP, "a stop b ", 4)


# ---------------------------------------------------------------- T = 1 through speculation

V, GAMMA, N_TOKENS = 6, 2, 3  # synthetic vocabulary, drafts per round, output tokens judged
PROMPT = [0, 1]
PARAMS = SamplingParams(frequency_penalty=1.2, presence_penalty=0.6, repetition_penalty=1.5, logit_bias=((3, 0.8),),
                        min_tokens=2)  # EOS (2) is suppressed at positions 0 and 1


def synthetic_tables():
    g = torch.Generator().manual_seed(5)
    target = torch.randn(V, V, generator=g) * 1.5  # logits of the next token given the last one
    draft = torch.softmax(torch.randn(V, V, generator=g), -1)  # the drafter: unaware of penalties
    return target, draft


def exact_law(target: torch.Tensor, proc: RequestProcessors) -> dict[tuple, float]:
    """P(t_1..t_3) under plain sampling from the processed target, position by position."""
    def p_next(out):
        last = out[-1] if out else PROMPT[-1]
        row = apply_processors(target[last][None, :], [proc], [list(out)])
        return torch.softmax(row[0].double(), -1)

    law = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        p = 1.0
        for k in range(N_TOKENS):
            p *= p_next(seq[:k])[seq[k]].item()
        law[seq] = p
    return law


def speculative_samples(target, draft, proc, n: int, seed: int) -> list[tuple]:
    """n requests decoded by rounds of γ drafts (from ``draft``, penalties ignored), verified by
    :func:`spec_round` against target rows processed per position, as the engine does."""
    gens = [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in range(n)]
    while True:
        live = [i for i in range(n) if len(outputs[i]) < N_TOKENS]
        if not live:
            return [tuple(o[:N_TOKENS]) for o in outputs]
        last = torch.tensor([outputs[i][-1] if outputs[i] else PROMPT[-1] for i in live])
        drafts, qs, cur = [], [], last
        for _ in range(GAMMA):
            q = draft[cur]
            cur = torch.multinomial(q, 1, generator=g).squeeze(1)
            drafts.append(cur)
            qs.append(q)
        d = torch.stack(drafts, 1)  # [R, γ]
        inputs = torch.cat([last[:, None], d], 1)  # row k of request r: after x_0..x_k
        logits = apply_processors(target[inputs.reshape(-1)], [proc] * len(live), [outputs[i] for i in live],
                                  d.tolist())
        r = len(live)
        res = spec_round(logits, torch.stack(qs, 1).reshape(-1, V), d.reshape(-1), [GAMMA] * r, [0] * r,
                         torch.ones(r), torch.zeros(r, dtype=torch.long), torch.ones(r), [gens[i] for i in live])
        for i, toks in zip(live, res.tokens):
            outputs[i].extend(toks)


def chi_square(law: dict[tuple, float], samples: list[tuple]) -> float:
    n = len(samples)
    counts = {k: 0 for k in law}
    for s in samples:
        counts[s] += 1
    big = [k for k in law if law[k] * n >= 5]
    rest = [k for k in law if law[k] * n < 5]
    obs = [counts[k] for k in big] + [sum(counts[k] for k in rest)]
    exp = [law[k] * n for k in big] + [sum(law[k] for k in rest) * n]
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.slow  # ~2.5 s
def test_speculative_t1_samples_the_processed_target_and_catches_the_per_row_bug(monkeypatch):
    """Three output tokens, rounds of γ = 2 drafts from a drafter that knows nothing of the
    penalties: their joint law equals plain sampling from the penalised target (chi-square over
    the 216 sequences), and processing every row with the output only (ignoring the draft
    prefix, the bug per-position processing avoids) is caught."""
    target, draft = synthetic_tables()
    proc = RequestProcessors.of(PARAMS, PROMPT, EOS)
    law = exact_law(target, proc)
    n = 1500
    good = chi_square(law, speculative_samples(target, draft, proc, n, seed=1))
    assert all(s[0] != EOS and s[1] != EOS for s in law if law[s] > 0)  # min_tokens held at positions 0, 1

    real = RequestProcessors.apply

    def output_only(self, logits, output, drafts=()):
        for k in range(logits.shape[0]):
            real(self, logits[k : k + 1], output, ())

    monkeypatch.setattr(RequestProcessors, "apply", output_only)
    bad = chi_square(law, speculative_samples(target, draft, proc, n, seed=1))
    print(f"\nchi-square p: per-position processing {good:.3g}, output-only (bug) {bad:.3g}")
    assert good > 0.01 and bad < 1e-4

"""Per-token logprobs of emitted tokens under the target's raw distribution.

Which distribution: ``log_softmax`` of the target's logits, before temperature,
top-k and top-p (vLLM's default ``raw_logprobs``; OpenAI does not specify one).
So the values are the same at any temperature and with or without speculation.

Which row: the emitted token k of a verification round comes from row k of its
request's span (row 0 = the anchor's row gives the first emitted token, row k =
draft x_k's row the (k+1)-th; :attr:`runtime.speculation.verifier.RoundResult.token_rows`);
the first token after prefill comes from the prompt's last row.
"""

from __future__ import annotations

from typing import Sequence

import torch

from runtime.interface import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """Logprob and top alternatives of one token per logits row, batched.

    Args:
        logits: ``[N, V]`` target logits (any float dtype; computed in fp32), one row
            per token — only the rows of requests that asked, so the cost is
            O(N·V) for those N tokens and nothing otherwise.
        token_ids: N emitted tokens (``token_ids[i]`` was produced from row i).
        num_top: per row, how many alternatives (``SamplingParams.logprobs``).

    Returns:
        N :class:`TokenLogprob` (plain Python ints/floats, safe to hand to
        another thread), ``top`` sorted most likely first (``torch.topk``).
    """
    n = len(token_ids)
    if n == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[torch.arange(n, device=lp.device), torch.as_tensor(list(token_ids), device=lp.device)].tolist()
    k = min(max(num_top), lp.shape[-1])
    vals, idx = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    vals, idx = vals.tolist(), idx.tolist()
    return [
        TokenLogprob(int(tok), chosen[i], list(zip(idx[i][: num_top[i]], vals[i][: num_top[i]])))
        for i, tok in enumerate(token_ids)
    ]

"""Preallocated slot KV cache with per-sequence lengths.

Layout per tensor: ``[num_layers, num_slots, num_kv_heads, max_len, head_dim]``.
A sequence owns one slot for its whole life; its cached length lives in
:attr:`KVCache.lengths`. Strides never change from step to step, so a compiled
forward sees the same tensor every time, and rolling back rejected draft tokens
is just lowering the length (:meth:`truncate`) — the stale entries beyond it are
overwritten by the next write and never read (attention reads ``[:length]``).
"""

from __future__ import annotations

import torch


class KVCache:
    """Slot-allocated K/V storage for the target (or draft) model.

    Args:
        num_layers: decoder layers.
        num_slots: max concurrent sequences.
        num_kv_heads, head_dim: attention geometry (GQA: kv heads < query heads).
        max_len: max tokens per sequence (prompt + completion + speculative lookahead).
        dtype, device: storage dtype/device (the serving dtype).

    Raises:
        RuntimeError: :meth:`allocate` when all slots are in use.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    # -- slot management ---------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        """Take a free slot (length 0)."""
        if not self._free:
            raise RuntimeError("no free KV-cache slot")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot; its memory is reused by the next sequence."""
        if slot in self._free:
            raise ValueError(f"slot {slot} freed twice")
        self.lengths[slot] = 0
        self._free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Roll back a sequence to ``length`` cached tokens (rejected drafts)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} from {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

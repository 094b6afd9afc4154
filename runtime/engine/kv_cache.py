"""Preallocated slot KV cache with per-sequence lengths, committed on demand.

Layout per tensor: ``[num_layers, num_slots, num_kv_heads, max_len, head_dim]``.
A sequence owns one slot for its whole life; its cached length lives in
:attr:`KVCache.lengths`. Strides never change from step to step, so a compiled
forward sees the same tensor every time, and rolling back rejected draft tokens
is just lowering the length (:meth:`truncate`) — the stale entries beyond it are
overwritten by the next write and never read (attention reads ``[:length]``).

Memory: on the CPU both tensors live in private anonymous memory (:func:`lazy_zeros`),
so the address space is reserved for every slot at full length but a page is only
committed when it is first written: 16 slots × 8,200 positions of the 135M target are
3.0 GB of address space, while the resident set grows with the tokens actually cached
(30 layers × 3 kv heads × 64 dims × 2 bytes × K and V ≈ 22.5 KiB per token). Freeing a
slot whose sequence outgrew :attr:`KVCache.keep_tokens` gives the pages past that
position back to the OS (they read as zeros again), so one long prompt does not pin its
memory for the life of the server.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

#: Tokens per slot whose pages :meth:`KVCache.free` keeps committed (short requests reuse them
#: without page faults); a longer sequence's pages past this position are released.
KEEP_TOKENS = 2048


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A CPU tensor of zeros whose pages are committed on first write.

    Backed by a private anonymous ``mmap`` (page-aligned; reads of never-written pages
    return zeros without committing memory) with transparent huge pages declined where
    the OS offers the advice, so a write commits 4 KiB, not 2 MiB. Returns the tensor and
    the mapping (``None`` for an empty shape or where ``mmap`` cannot map anonymously —
    then an ordinary ``torch.zeros``).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or sys.platform == "win32":
        return torch.zeros(shape, dtype=dtype), None
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps a reference to buf: the mapping lives as long as the tensor.
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape), buf


class KVCache:
    """Slot-allocated K/V storage for the target (or draft) model.

    Args:
        num_layers: decoder layers.
        num_slots: max concurrent sequences.
        num_kv_heads, head_dim: attention geometry (GQA: kv heads < query heads).
        max_len: max tokens per sequence (prompt + completion + speculative lookahead).
        dtype, device: storage dtype/device (the serving dtype). On the CPU the storage
            is committed on first write (module docstring); elsewhere it is ``torch.zeros``.
        keep_tokens: positions per slot whose pages stay committed when the slot is freed.

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
        keep_tokens: int = KEEP_TOKENS,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self._maps: list[mmap.mmap] = []
        if torch.device(device).type == "cpu":
            (self.k, mk), (self.v, mv) = lazy_zeros(shape, dtype), lazy_zeros(shape, dtype)
            self._maps = [m for m in (mk, mv) if m is not None]
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len
        self.keep_tokens = keep_tokens
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
        """Return a slot; its memory is reused by the next sequence. If its sequence held
        more than ``keep_tokens`` positions, the pages past them go back to the OS."""
        if slot in self._free:
            raise ValueError(f"slot {slot} freed twice")
        if self.lengths[slot] > self.keep_tokens:
            self.release(slot, self.keep_tokens)
        self.lengths[slot] = 0
        self._free.append(slot)

    def release(self, slot: int, start: int) -> None:
        """Give back the committed pages of positions ``[start, max_len)`` of ``slot`` (every
        layer and kv head, K and V). Whole pages only: a page that also holds a position before
        ``start`` (or the next head's row) keeps its contents; released pages read as zeros.
        Neither is read before it is written again (attention reads ``[:length]``). No-op
        for storage not from :func:`lazy_zeros`."""
        if not self._maps or start >= self.max_len:
            return
        num_layers, num_slots, kv_heads, length, head_dim = self.k.shape
        item = head_dim * self.k.element_size()  # bytes per position
        page = mmap.PAGESIZE
        for buf in self._maps:
            for layer in range(num_layers):
                for head in range(kv_heads):
                    row = ((layer * num_slots + slot) * kv_heads + head) * length
                    lo = -(-(row + start) * item // page) * page  # round up to a page
                    hi = (row + length) * item // page * page
                    if hi > lo:
                        buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def truncate(self, slot: int, length: int) -> None:
        """Roll back a sequence to ``length`` cached tokens (rejected drafts)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} from {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def nbytes(self) -> int:
        """Bytes of address space of K and V (all slots at full length), not the resident part."""
        return self.k.numel() * self.k.element_size() * 2

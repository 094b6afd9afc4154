"""The slot KV cache: slot bookkeeping, and storage committed on first write — an 8,192-token
cache for 16 sequences reserves 3 GB of address space but holds memory only for the
positions written; freeing a long sequence's slot gives its pages past ``keep_tokens`` back."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from runtime.engine.kv_cache import KVCache
from runtime.speculation.drafter import DraftContextCache

# The served target's geometry (SmolLM2-135M: 30 layers, 3 kv heads of 64) at the default context.
LAYERS, SLOTS, KV_HEADS, HEAD_DIM, MAX_LEN = 30, 16, 3, 64, 8192 + 8
TOKEN_BYTES = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # bf16, K and V: 23,040 bytes per cached token
MIB = 2**20


def resident_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the pages holding ``tensors`` that this process has written: the pages'
    ``/proc/self/pagemap`` entries that are present and mapped by this process alone (a page
    that was only read maps the kernel's shared zero page: not counted). Reads the tensors'
    own pages only — the kernel may merge their mapping with a neighbour's, so the mapping's
    ``Rss`` in ``/proc/self/smaps`` can count memory that is not theirs."""
    page, total = mmap.PAGESIZE, 0
    with open("/proc/self/pagemap", "rb") as f:
        for t in tensors:
            lo = t.data_ptr() // page
            hi = -(-(t.data_ptr() + t.numel() * t.element_size()) // page)
            f.seek(lo * 8)
            entries = np.frombuffer(f.read((hi - lo) * 8), dtype=np.uint64)
            total += int(np.count_nonzero((entries >> np.uint64(63)) & (entries >> np.uint64(56)) & np.uint64(1))) * page
    return total


@pytest.fixture()
def cache():
    return KVCache(LAYERS, SLOTS, KV_HEADS, HEAD_DIM, MAX_LEN, torch.bfloat16)


def test_storage_is_committed_as_positions_are_written(cache):
    assert cache.k.shape == (LAYERS, SLOTS, KV_HEADS, MAX_LEN, HEAD_DIM) and cache.k.dtype == torch.bfloat16
    assert cache.nbytes() == LAYERS * SLOTS * KV_HEADS * MAX_LEN * HEAD_DIM * 2 * 2 > 3 * 10**9
    assert resident_bytes(cache.k, cache.v) == 0  # nothing committed by allocating
    assert float(cache.k[:, :, :, ::997].abs().sum()) == 0  # unwritten entries read as zeros ...
    assert resident_bytes(cache.k, cache.v) == 0  # ... without committing them

    slot = cache.allocate()
    n = 3000
    cache.k[:, slot, :, :n] = 1.5
    cache.v[:, slot, :, :n] = -2.0
    cache.lengths[slot] = n
    used = resident_bytes(cache.k, cache.v)
    # n positions of one slot, in whole 4 KiB pages per (layer, kv head) row of K and V
    assert n * TOKEN_BYTES <= used <= n * TOKEN_BYTES + LAYERS * KV_HEADS * 2 * 2 * 4096
    assert float(cache.k[:, slot, :, :n].float().mean()) == 1.5 and float(cache.v[:, slot, :, :n].float().mean()) == -2.0
    other = cache.allocate()
    assert other != slot and float(cache.k[:, other].abs().sum()) == 0


def test_freeing_a_long_sequence_releases_its_pages_past_keep_tokens(cache):
    slot = cache.allocate()
    n = 6000
    cache.k[:, slot, :, :n] = 1.0
    cache.v[:, slot, :, :n] = 1.0
    cache.lengths[slot] = n
    before = resident_bytes(cache.k, cache.v)
    cache.free(slot)
    after = resident_bytes(cache.k, cache.v)
    kept = cache.keep_tokens
    assert kept == 2048
    assert kept * TOKEN_BYTES <= after <= (kept + 64) * TOKEN_BYTES < before
    assert float(cache.k[:, slot, :, :kept].float().mean()) == 1.0  # the kept positions keep their values
    assert float(cache.k[:, slot, :, kept + 64:].abs().sum()) == 0  # the released ones read as zeros

    again = cache.allocate()  # a short sequence in a slot: nothing released
    cache.k[:, again, :, :100] = 3.0
    cache.lengths[again] = 100
    resident = resident_bytes(cache.k, cache.v)
    cache.free(again)
    assert resident_bytes(cache.k, cache.v) == resident


def test_slot_bookkeeping(cache):
    slots = [cache.allocate() for _ in range(SLOTS)]
    assert sorted(slots) == list(range(SLOTS)) and cache.num_free == 0 and cache.num_used == SLOTS
    with pytest.raises(RuntimeError, match="no free KV-cache slot"):
        cache.allocate()
    cache.lengths[slots[3]] = 10
    cache.truncate(slots[3], 7)
    assert cache.lengths[slots[3]] == 7
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(slots[3], 8)
    cache.free(slots[3])
    assert cache.num_free == 1 and cache.lengths[slots[3]] == 0
    with pytest.raises(ValueError, match="freed twice"):
        cache.free(slots[3])
    assert cache.allocate() == slots[3]


def test_the_drafters_context_cache_is_committed_on_write_too():
    d = DraftContextCache(2, SLOTS, KV_HEADS, HEAD_DIM, MAX_LEN, block_size=7)
    assert d.k.shape == (2, SLOTS, KV_HEADS, MAX_LEN + 7, HEAD_DIM) and d.max_len == MAX_LEN
    assert resident_bytes(d.k, d.v) == 0
    d.k[:, 0, :, :64] = 1.0
    assert 0 < resident_bytes(d.k, d.v) <= 2 * KV_HEADS * 64 * HEAD_DIM * 2 + 2 * KV_HEADS * 2 * 4096
    d.k[:, 1, :, :5000] = 1.0  # a long sequence in slot 1, then a new one starts there
    d.lengths[1] = 5000
    long = resident_bytes(d.k, d.v)
    d.reset(1)
    assert d.lengths[1] == 0
    assert long - resident_bytes(d.k, d.v) >= 2 * KV_HEADS * (5000 - d.keep_tokens - 64) * HEAD_DIM * 2
    assert float(d.k[:, 1, :, :d.keep_tokens].float().mean()) == 1.0

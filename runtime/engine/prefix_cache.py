"""Automatic prefix caching: reuse the KV of shared prompt prefixes across requests.

Every chat request starts with the same chat-template header (default system prompt),
and multi-turn agents resend the whole history each turn, so most prompt tokens were
already prefilled by an earlier request. This store keeps their KV and copies it into
the next request's slot instead of recomputing it (vLLM's "automatic prefix caching",
adapted to the engine's slot KV cache: :mod:`runtime.engine.kv_cache` gives every sequence one
contiguous slot, so blocks are *copied* in and out of a separate pool rather than
shared by reference — no reference counts, any stored block can be evicted any time).

Blocks. A sequence's tokens are cut into full blocks of ``block_size`` tokens. Block i
is keyed by a hash chain ``h_i = blake2b(h_{i−1} ‖ tokens of block i)`` (``h_{−1} = b""``),
so a key names the *whole prefix* up to the block's end: equal keys ⇒ equal prefixes
⇒ equal KV (attention is causal; RoPE positions are the absolute ones, ``i·block_size``…).
A 128-bit digest makes an accidental (or crafted) collision practically impossible.
A request's ``cache_salt`` seeds the chain (``h_{−1} = blake2b(salt)``): requests share
blocks only with requests of the same salt, so one tenant cannot learn from time to
first token whether another tenant recently sent a prompt (the gateway salts by tenant,
``SPARKGATE_PREFIX_CACHE_SCOPE``).

Stores. The pool mirrors one or more slot stores with the layout
``k, v: [num_layers, num_slots, num_kv_heads, max_len, head_dim]`` and a per-slot
``lengths`` list — the target :class:`runtime.engine.kv_cache.KVCache` and, for DSpark /
parallel speculation, the drafter's :class:`runtime.speculation.drafter.DraftContextCache`
(its per-position context K/V are a function of the target's hidden states at that
position, i.e. of the prefix too, so they are cached alongside and a restored prefix
needs no target taps). Pool tensors are ``[num_layers, num_blocks, num_kv_heads,
block_size, head_dim]`` per store, in the store's dtype.

Lifecycle (driven by :class:`runtime.engine.scheduler.BatchScheduler`):

* :meth:`restore` on admission: copy the longest cached chain of full blocks of the
  prompt into the new slot (never the whole prompt: ≥ 1 token is left to prefill so
  the last prompt token's logits are computed), set every store's length to it.
* :meth:`insert` when a prompt's prefill completes and when a sequence leaves (finished
  or aborted: its completion tokens are history for the next turn): copy its not yet
  stored full blocks out of the slot. Only positions valid in *every* store count
  (``min`` of the lengths and of the known tokens), so a rolled-back draft, a
  half-committed step or an aborted prefill never stores a wrong block.

Optional stores. The ``hybrid`` speculator may abandon a request's drafter context (it
drafts n-grams only from then on: :meth:`runtime.speculation.speculator.Speculator.commit`),
so its draft store covers fewer positions than the target. Such a store is passed as
*optional*: blocks are stored for the positions valid in every required store, and each
block records whether each optional store's data was stored with it. :meth:`restore`
restores an optional store only over the leading matched blocks that cover it (its
length may be shorter than the target's), and :meth:`insert` of a block already cached
without that store's data adds it when the slot now has it.

Eviction (pool full): least recently used block first. Matches and inserts touch a
chain from its last block back to its first, so a parent is always more recent than
its children and is never evicted before them (no unreachable orphans).

Counters (vLLM v1 names, in tokens): :attr:`queries` (prompt tokens looked up) and
:attr:`hits` (of those, restored from the pool); hit rate = hits / queries.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol, Sequence

import torch


class SlotStore(Protocol):
    """What the pool mirrors: :class:`~runtime.engine.kv_cache.KVCache` or a DraftContextCache."""

    k: torch.Tensor  # [num_layers, num_slots, num_kv_heads, max_len(+scratch), head_dim]
    v: torch.Tensor
    lengths: list[int]


def chain_root(salt: str | None) -> bytes:
    """The hash chain's starting value: ``b""`` without a salt, else the salt's digest.

    Requests with different salts get disjoint keys, so they never share (or can time)
    each other's cached prefixes — vLLM's ``cache_salt``; the gateway salts per tenant.
    """
    if not salt:
        return b""
    return hashlib.blake2b(b"salt:" + salt.encode(), digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int,
                 salt: str | None = None) -> list[bytes]:
    """Hash-chain keys of the first ``num_blocks`` full blocks of ``token_ids`` (16-byte
    digests), in the namespace of ``salt`` (:func:`chain_root`)."""
    out: list[bytes] = []
    parent = chain_root(salt)
    for i in range(num_blocks):
        tokens = array("I", token_ids[i * block_size : (i + 1) * block_size])
        parent = hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Block-granular KV store of prompt prefixes with LRU eviction.

    Args:
        stores: slot stores whose positions are cached together (target KV first; see
            the module docstring). All must share slot ids.
        optional: per store, whether it may cover fewer positions than the others
            (module docstring, "Optional stores"); default: none.
        num_blocks: pool capacity in blocks (≥ 1; the engine builds none for 0).
        block_size: tokens per block (vLLM's default is 16; the SmolLM2 chat header
            with its default system prompt is 20+ tokens, so 16 already catches it).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` < 1, or no stores.
    """

    def __init__(self, stores: Sequence[SlotStore], num_blocks: int, block_size: int = 16,
                 optional: Sequence[bool] | None = None) -> None:
        optional = list(optional) if optional is not None else [False] * len(stores)
        if num_blocks < 1 or block_size < 1 or not stores or len(optional) != len(stores) or all(optional):
            raise ValueError(f"need num_blocks ≥ 1, block_size ≥ 1, ≥ 1 required store and a flag per store; "
                             f"got {num_blocks}, {block_size}, {len(stores)} stores, optional {optional}")
        self.stores = list(stores)
        self.optional = optional
        #: per store, per pool block: whether the block holds that store's data (required stores: always)
        self._covered = [[not opt] * num_blocks for opt in optional]
        self.num_blocks = num_blocks
        self.block_size = block_size
        # torch.empty: pages are only touched (resident) once a block is written.
        self._pools = [
            tuple(torch.empty((t.shape[0], num_blocks, t.shape[2], block_size, t.shape[4]), dtype=t.dtype,
                              device=t.device) for t in (s.k, s.v))
            for s in self.stores
        ]
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # block key → pool index, least recent first
        self._free = list(range(num_blocks - 1, -1, -1))
        self.queries = 0  # prompt tokens looked up (vLLM ``prefix_cache_queries``)
        self.hits = 0  # of those, restored from the pool (vLLM ``prefix_cache_hits``)
        self.evictions = 0  # blocks evicted to make room

    # -- state -------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def nbytes(self) -> int:
        """Pool capacity in bytes (all stores, K and V)."""
        return sum(t.numel() * t.element_size() for pool in self._pools for t in pool)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    # -- restore -----------------------------------------------------------------
    def restore(self, slot: int, prompt_ids: Sequence[int], salt: str | None = None) -> int:
        """Copy the longest cached prefix of ``prompt_ids`` into ``slot``; return its length.

        Sets every store's ``lengths[slot]`` to the returned token count (a multiple of
        ``block_size``, ``< len(prompt_ids)``; 0 on a miss) and counts the query. Only
        blocks inserted with the same ``salt`` match.
        """
        B = self.block_size
        n = len(prompt_ids)
        matched: list[tuple[bytes, int]] = []
        parent = chain_root(salt)
        for i in range((n - 1) // B):  # leave ≥ 1 token to prefill
            tokens = array("I", prompt_ids[i * B : (i + 1) * B])
            key = hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()
            idx = self._lru.get(key)
            if idx is None:
                break
            matched.append((key, idx))
            parent = key
        for key, _ in reversed(matched):
            self._lru.move_to_end(key)
        m = len(matched) * B
        for store, pool, covered in zip(self.stores, self._pools, self._covered):
            nb = 0  # leading matched blocks that hold this store's data
            while nb < len(matched) and covered[matched[nb][1]]:
                nb += 1
            if nb:
                ids = torch.tensor([idx for _, idx in matched[:nb]], dtype=torch.long)
                for dst, src in zip((store.k, store.v), pool):
                    L, _, H, _, D = src.shape
                    dst[:, slot, :, : nb * B] = src[:, ids].permute(0, 2, 1, 3, 4).reshape(L, H, nb * B, D)
            store.lengths[slot] = nb * B
        self.queries += n
        self.hits += m
        return m

    # -- insert ------------------------------------------------------------------
    def insert(self, slot: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Store the full blocks of ``slot`` not yet in the pool (keyed in the namespace of
        ``salt``); return how many were added.

        Only the first ``min(len(token_ids), lengths[slot] of every required store)``
        positions are trusted (position t of the slot holds the KV of ``token_ids[t]``); an
        optional store's data goes with the blocks inside its own length. Stops early,
        keeping what fits, when the pool holds nothing older than this chain.
        """
        B = self.block_size
        valid = min([len(token_ids)] + [s.lengths[slot] for s, o in zip(self.stores, self.optional) if not o])
        keys = block_hashes(token_ids, B, valid // B, salt)
        chain = set(keys)
        new: list[tuple[int, int]] = []  # (block index in the sequence, pool index)
        old: list[tuple[int, int]] = []  # blocks already cached (an optional store may add its data)
        stored = 0
        for i, key in enumerate(keys):
            if key in self._lru:
                self._lru.move_to_end(key)  # protect it from this insert's evictions
                old.append((i, self._lru[key]))
            else:
                idx = self._take_block(chain)
                if idx is None:
                    break
                self._lru[key] = idx
                new.append((i, idx))
            stored = i + 1
        for key in reversed(keys[:stored]):
            self._lru.move_to_end(key)
        for store, pool, opt, covered in zip(self.stores, self._pools, self.optional, self._covered):
            write = new
            if opt:
                have = min(valid, store.lengths[slot]) // B  # blocks of this slot the store holds
                for _, idx in new:
                    covered[idx] = False
                write = [(i, idx) for i, idx in new + old if i < have and not covered[idx]]
                for _, idx in write:
                    covered[idx] = True
            if not write:
                continue
            blocks = torch.tensor([i for i, _ in write], dtype=torch.long)
            ids = torch.tensor([idx for _, idx in write], dtype=torch.long)
            nb = max(i for i, _ in write) + 1  # the slot prefix that holds every written block
            for src, dst in zip((store.k, store.v), pool):
                L, H, D = src.shape[0], src.shape[2], src.shape[4]
                blocked = src[:, slot, :, : nb * B].view(L, H, nb, B, D)
                dst[:, ids] = blocked[:, :, blocks].permute(0, 2, 1, 3, 4)
        return len(new)

    def _take_block(self, protect: set[bytes]) -> int | None:
        """A free pool index, evicting the least recently used block if needed;
        ``None`` if that block belongs to ``protect`` (the chain being inserted)."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        key = next(iter(self._lru))
        if key in protect:
            return None
        self.evictions += 1
        return self._lru.pop(key)

    def clear(self) -> None:
        """Forget every block (counters are kept)."""
        self._lru.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))


def engine_prefix_cache(config, cache, speculator=None) -> PrefixCache | None:
    """The engine's prefix cache (``None`` when ``config.prefix_cache_blocks`` is 0).

    Args:
        config: :class:`runtime.config.EngineConfig` (``prefix_cache_blocks``,
            ``prefix_block_size``).
        cache: the target KV cache.
        speculator: the engine's :class:`runtime.speculation.speculator.Speculator`, if any; its
            draft context cache (DSpark / parallel) is cached alongside the target KV.
    """
    if config.prefix_cache_blocks <= 0:
        return None
    stores, optional = [cache], [False]
    if speculator is not None and speculator.dcache is not None:
        stores.append(speculator.dcache)
        optional.append(speculator.context_optional)
    return PrefixCache(stores, config.prefix_cache_blocks, config.prefix_block_size, optional)

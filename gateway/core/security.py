"""API keys: generation, SHA-256 digests, visible prefixes and the positive-lookup cache.

A key is ``sk-sg-`` + ``secrets.token_urlsafe(32)`` (256 random bits). Only its
SHA-256 hex digest is stored (a fast hash is enough for a random 256-bit secret;
lookups go through the unique index on the digest) plus the first
:data:`PREFIX_LEN` characters so operators can list and revoke keys.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from datetime import datetime

KEY_PREFIX = "sk-sg-"
PREFIX_LEN = 12  # "sk-sg-" + 6 random characters, shown in `sparkgate keys list`


def generate_api_key() -> str:
    """A new plaintext key (shown to the user once, never stored)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """SHA-256 hex digest (64 chars) under which a key is stored and looked up."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def visible_prefix(key: str) -> str:
    return key[:PREFIX_LEN]


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant and user label of an authenticated key.

    ``key_id`` is None for the admin token. ``expires_at`` is re-checked on every
    cache hit so a cached key stops working exactly when it expires.
    """

    tenant: str
    user_label: str | None = None
    key_id: int | None = None
    expires_at: datetime | None = None
    token_budget: int | None = None
    is_admin: bool = False


class AuthCache:
    """In-process cache of successful key lookups: digest → (principal, deadline).

    Entries live ``ttl_s`` seconds (default 5 s), so a key revoked from another
    process (the CLI) stops working within ``ttl_s``; revocations through
    :meth:`invalidate` act at once. Failed lookups are never cached (a new key works
    immediately). Size is bounded by ``max_entries``.
    """

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, tuple[Principal, float]] = {}

    def get(self, digest: str) -> Principal | None:
        hit = self._entries.get(digest)
        if hit is None:
            return None
        principal, deadline = hit
        if self._clock() >= deadline:
            return None  # kept for get_stale() until evicted
        return principal

    def get_stale(self, digest: str) -> Principal | None:
        """The last principal cached for ``digest``, even past its TTL: lets known keys keep
        working while the database is down (revocations then wait for the database)."""
        hit = self._entries.get(digest)
        return None if hit is None else hit[0]

    def put(self, digest: str, principal: Principal) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= self.max_entries:
            now = self._clock()
            self._entries = {d: e for d, e in self._entries.items() if e[1] > now}
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
        self._entries[digest] = (principal, self._clock() + self.ttl_s)

    def invalidate(self, digest: str | None = None) -> None:
        """Forget one digest, or everything when ``digest`` is None."""
        if digest is None:
            self._entries.clear()
        else:
            self._entries.pop(digest, None)

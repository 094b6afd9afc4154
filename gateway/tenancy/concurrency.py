"""A tenant's ``max_concurrent`` held over all replicas: leases in Redis.

Each admitted request of a tenant whose tier has ``max_concurrent`` holds one **lease**: a
member ``<request id>`` of the sorted set ``<prefix>conc:<tenant>`` whose score is the
lease's expiry (Redis ``TIME``, seconds). Taking a lease is one Lua script (drop expired
members, count, add if below the limit), so two replicas never both take the last slot.
The replica that holds a lease re-arms it every ``refresh_s`` (:meth:`LeaseStore.refresh`)
and removes it when the request ends; a replica that dies (SIGKILL) stops re-arming, so its
leases lapse after ``ttl_s`` seconds and the slots come back.

If Redis fails, :class:`gateway.tenancy.admission.AdmissionController` logs a warning and
falls back to its own per-replica count (N replicas then allow N × ``max_concurrent``);
serving never stops because of this store.
"""

from __future__ import annotations

_TAKE = """
local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000) + 1000)
return 1
"""

_REFRESH = """
local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000)
return 1
"""

_COUNT = """
local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""


class LeaseStore:
    """Concurrency leases in Redis (module docstring). ``client``: a ``redis.asyncio``
    client (shared with the rate-limit buckets); ``ttl_s``: lease lifetime in seconds
    without a refresh."""

    def __init__(self, client, prefix: str = "sparkgate:", ttl_s: float = 10.0):
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._take = client.register_script(_TAKE)
        self._refresh = client.register_script(_REFRESH)
        self._count = client.register_script(_COUNT)

    def key(self, tenant: str) -> str:
        return f"{self.prefix}conc:{tenant}"

    async def take(self, tenant: str, lease: str, limit: int) -> bool:
        """Take a slot for ``lease`` if the tenant holds fewer than ``limit`` live leases
        (idempotent for a lease already held). Raises the Redis error if Redis fails."""
        return bool(int(await self._take(keys=[self.key(tenant)], args=[limit, self.ttl_s, lease])))

    async def release(self, tenant: str, lease: str) -> None:
        await self.client.zrem(self.key(tenant), lease)

    async def refresh(self, leases: dict[str, list[str]]) -> None:
        """Re-arm live leases: ``{tenant: [lease, ...]}`` (released ones are not re-added)."""
        for tenant, ids in leases.items():
            if ids:
                await self._refresh(keys=[self.key(tenant)], args=[self.ttl_s, *ids])

    async def count(self, tenant: str) -> int:
        """Live leases of ``tenant`` over all replicas."""
        return int(await self._count(keys=[self.key(tenant)], args=[]))

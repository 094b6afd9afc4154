"""What the backends that stream from remote servers share — the OpenAI-compatible one
(:mod:`runtime.upstream.client`) and SGLang's (:mod:`runtime.sglang.client`): the served model's
tokenizer (the gateway templates and counts), one pooled HTTP client, the router with its
health-check task, background tasks that outlive a cancelled request (aborts, drains), and the
EOS id. Each backend adds its request mapping, its health loop and what it reports.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from runtime.engine.detokenizer import GatewayTokenization, load_tokenizer
from runtime.upstream.router import UpstreamRouter

log = logging.getLogger(__name__)


class RemoteBackend(GatewayTokenization):
    """Lifecycle shared by the remote backends.

    Args:
        config: the backend's settings; read here: ``tokenizer_path``, ``eos_token_id``,
            ``read_timeout_s`` and ``connect_timeout_s`` (seconds).
        router: the servers and their health.
        tokenizer: injected tokenizer (tests); loaded from ``config.tokenizer_path`` otherwise.
        transport: injected httpx transport (tests).

    Class attributes a backend sets: ``label`` (names its servers in log lines) and
    ``background_timeout_s`` (how long :meth:`stop` waits for background tasks, seconds).
    """

    label = "remote"
    background_timeout_s = 5.0

    def __init__(self, config: Any, router: UpstreamRouter, *, tokenizer: Any = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.router = router
        self._tokenizer = tokenizer
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    async def _open_client(self, *, max_keepalive: int, headers: dict[str, str] | None = None) -> None:
        """Load the tokenizer (unless injected), open the HTTP client and probe every server once;
        none healthy yet is a warning, not an error (requests fail until a probe finds one)."""
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer_path)
        self._client = httpx.AsyncClient(
            headers=headers,
            transport=self._transport,
            timeout=httpx.Timeout(self.config.read_timeout_s, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max_keepalive),
        )
        if not await self.router.check_all(self._client):
            log.warning("no %s upstream is healthy yet: %s", self.label,
                        {u.url: u.last_error for u in self.router.upstreams})

    async def stop(self) -> None:
        """Stop the health checks, wait up to ``background_timeout_s`` for background tasks, close
        the HTTP client."""
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.background_timeout_s)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` as a task that outlives a cancelled caller (kept until done)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _eos_token_id(self) -> int:
        """``config.eos_token_id``, else the tokenizer's, else 0 (no tokenizer yet)."""
        eos = self.config.eos_token_id
        if eos is None:
            eos = getattr(self._tokenizer, "eos_token_id", None)
        return int(eos if eos is not None else 0)

"""A FAKE OpenAI-compatible server (``/v1/completions`` streaming, ``/health``, ``/v1/models``) —
no model inside — for the tests of the OpenAI-compatible upstream backend
(:mod:`runtime.upstream.client`).

It speaks the wire format of vLLM's and SGLang's ``/v1/completions`` stream: ``data: <chunk>``
SSE lines of ``text_completion`` objects (``choices[0].text`` / ``finish_reason`` /
``logprobs`` / ``token_ids``), a usage chunk (``choices: []``) when ``stream_options.include_usage``,
then ``data: [DONE]``. The reply is :attr:`FakeUpstream.script` (one chunk per piece, one token
each, token ids :data:`FIRST_ID` + i), cut at ``max_tokens`` (``finish_reason: "length"``).

Knobs make it refuse (HTTP status), send an error object after k chunks, stall before the
headers or after k chunks, or report unhealthy. It records every request body and its
headers and connection, the streams the client closed before the end (``disconnects``), and the most
requests it streamed at once (``max_in_flight``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FIRST_ID = 1000  # token id of the script's first piece
SCRIPT = ("Hello", " world", ",", " how", " are", " you", "?")


@dataclass
class FakeUpstream:
    """State and knobs of one fake server (attributes are read per request)."""

    script: tuple[str, ...] = SCRIPT
    chunk_delay_s: float = 0.0
    fail_status: int | None = None
    retry_after: str | None = None
    error_after: int | None = None  # send an error object after this many text chunks
    stall_before_headers_s: float = 0.0
    stall_after: int | None = None  # after this many text chunks, send nothing for stall_s
    stall_s: float = 30.0
    healthy: bool = True
    cached_tokens: int | None = None
    requests: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    peers: list[tuple] = field(default_factory=list)  # the client address of each request (its connection)
    disconnects: list[int] = field(default_factory=list)  # request index of each stream closed early
    completed: list[int] = field(default_factory=list)
    health_checks: int = 0
    health_auth: list = field(default_factory=list)  # the Authorization header of each probe
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self) -> None:
        """Back to the defaults (records cleared)."""
        fresh = FakeUpstream()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    # -- the stream -------------------------------------------------------------------
    def _chunk(self, text: str, finish: str | None, body: dict, ids: list[int]) -> dict:
        choice: dict = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if body.get("logprobs") is not None and ids:
            n = int(body["logprobs"])
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: f"tok{t}")
            # the sampled token first at −0.5, then n alternatives below it, the sampled one
            # repeated in the dict as vLLM does
            choice["logprobs"] = {
                "text_offset": [0] * len(ids),
                "tokens": [name(t) for t in ids],
                "token_logprobs": [-0.5] * len(ids),
                "top_logprobs": [{**{name(t + 1 + k): -1.0 - k for k in range(n)}, name(t): -0.5} for t in ids],
            }
        return {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": body.get("model"),
                "choices": [choice], "usage": None}

    async def _stream(self, index: int, body: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        done = False
        try:
            limit = body.get("max_tokens") or 16
            pieces = list(self.script[:limit])
            finish = "length" if len(self.script) > limit else "stop"
            for i, piece in enumerate(pieces):
                if self.error_after is not None and i == self.error_after:
                    yield f"data: {json.dumps({'error': {'message': 'fake upstream error', 'type': 'InternalServerError', 'code': 500}})}\n\n"
                    done = True
                    return
                if self.stall_after is not None and i == self.stall_after:
                    await asyncio.sleep(self.stall_s)
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                last = i == len(pieces) - 1
                yield f"data: {json.dumps(self._chunk(piece, finish if last else None, body, [FIRST_ID + i]))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(pieces),
                         "total_tokens": len(body["prompt"]) + len(pieces)}
                if self.cached_tokens is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
                yield f"data: {json.dumps({'id': 'cmpl-fake', 'object': 'text_completion', 'created': 1, 'model': body.get('model'), 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            done = True
        finally:
            self.in_flight -= 1
            (self.completed if done else self.disconnects).append(index)

    # -- routes -----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await request.json()
        index = len(self.requests)
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.peers.append(tuple(request.client))
        if self.stall_before_headers_s:
            await asyncio.sleep(self.stall_before_headers_s)
        if self.fail_status is not None:
            headers = {"Retry-After": self.retry_after} if self.retry_after else None
            return JSONResponse({"error": {"message": f"fake upstream refuses with {self.fail_status}",
                                           "type": "BadRequestError", "code": self.fail_status}},
                                status_code=self.fail_status, headers=headers)
        return StreamingResponse(self._stream(index, body), media_type="text/event-stream")

    async def health(self, request: Request) -> Response:
        self.health_checks += 1
        self.health_auth.append(request.headers.get("authorization"))
        return Response(status_code=200 if self.healthy else 503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                                 Route("/health", self.health), Route("/v1/models", self.models)])


class UpstreamServer:
    """Serves a :class:`FakeUpstream` with uvicorn on 127.0.0.1 in a daemon thread (port 0:
    an ephemeral one; a given port: e.g. the same one again after :meth:`stop`)."""

    def __init__(self, fake: FakeUpstream | None = None, port: int = 0) -> None:
        self.fake = fake or FakeUpstream()
        self.port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> UpstreamServer:
        config = uvicorn.Config(self.fake.app(), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fake-openai-upstream", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake upstream did not start")
            time.sleep(0.005)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(5)

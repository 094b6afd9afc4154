"""The Responses API's output: the response object, its output items, and the streamed events.

A reply becomes output items in the order it says things (:class:`ResponseFormatter`): text
→ a ``message`` item (``msg_…``, role assistant, one ``output_text`` part with
``annotations: []``); each tool call (with tools, parsed by
:class:`~gateway.openai.tool_parser.ToolCallParser`) → a ``function_call`` item (``fc_…``,
``call_id`` ``call_…``, ``name``, ``arguments`` the JSON text the model wrote); text after a
call opens a new message item. A reply with neither gets one empty message. Streamed and
whole replies go through the same steps, so they give the same items.

Streamed (``text/event-stream``, each event ``event: <type>`` + ``data: <json>`` with its
``type`` and a ``sequence_number`` counting from 0; no ``[DONE]``): ``response.created``,
``response.in_progress``; per message item ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` …, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per call
``response.output_item.added``, ``response.function_call_arguments.delta`` …,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the reply:
status ``incomplete``, ``incomplete_details.reason`` ``"max_output_tokens"``, the last item
``incomplete``), or ``response.failed`` (status ``failed``, ``error`` ``{code, message}``)
when the engine fails after the stream began.

``usage``: ``input_tokens`` (prompt), ``input_tokens_details.cached_tokens`` (prompt tokens
the prefix cache served, as chat's ``prompt_tokens_details``; 0 when the backend does not
say), ``output_tokens``, ``output_tokens_details.reasoning_tokens`` 0, ``total_tokens``.
Source: OpenAI API reference, "Responses" (the response object) and "Streaming events".
"""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

from gateway.core.errors import APIError, server_error
from gateway.openai.generation import EventStream, failure_error, is_normal_finish
from gateway.openai.responses_schemas import FunctionToolSpec, ResponsesRequest
from gateway.openai.tool_parser import Piece, ToolCallParser
from runtime.interface import Finished, FinishReason, TextDelta

log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    """``resp_`` / ``msg_`` / ``fc_`` + 48 hex characters (OpenAI's ids have this shape)."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


def request_echo(body: ResponsesRequest, tools: list[FunctionToolSpec]) -> dict:
    """The request fields every response object repeats, with OpenAI's defaults filled in."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": dict(body.metadata or {}),
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": True if body.store is None else body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"},
                 "verbosity": "medium"},
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": [t.model_dump() for t in tools],
        "top_logprobs": 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
    }


class ResponseFormatter:
    """One response: its id, its output items as the reply arrives, its events and object.

    Args:
        model: the served model's name.
        prompt_tokens: the prompt's length (``usage.input_tokens``).
        echo: :func:`request_echo` of the request.
        tool_calls: parse the reply for tool calls (the request has tools and a choice other
            than ``none``).
        return_spec_stats: add ``spec_stats`` (Sparkgate extension) to the final object.
        response_id: the id (default a new ``resp_…``).

    Attributes used by :func:`gateway.openai.respond.respond`: ``id`` (``resp_…``, also the
    request record's id), ``model``, ``num_top_logprobs`` (always None).
    """

    num_top_logprobs = None

    def __init__(self, model: str, prompt_tokens: int, echo: dict, tool_calls: bool = False,
                 return_spec_stats: bool = False, response_id: str | None = None):
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.echo = echo
        self.parser = ToolCallParser() if tool_calls else None
        self.return_spec_stats = return_spec_stats
        self.output: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._seq = 0

    # -- events ---------------------------------------------------------------------------
    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _item_event(self, type_: str, **fields) -> dict:
        return self._event(type_, item_id=self._open["id"], output_index=len(self.output) - 1, **fields)

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))]

    def _content(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed")
            events += self._add({"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                                 "content": []})
            part = {"type": "output_text", "annotations": [], "text": ""}
            self._open["content"].append(part)
            events.append(self._item_event("response.content_part.added", content_index=0, part=dict(part)))
        if text:
            self._open["content"][0]["text"] += text
            events.append(self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, piece: Piece) -> list[dict]:
        return self._close("completed") + self._add({
            "id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
            "call_id": piece.id, "name": piece.name})

    def _arguments(self, text: str) -> list[dict]:
        self._open["arguments"] += text
        return [self._item_event("response.function_call_arguments.delta", delta=text)]

    def _close(self, status: str) -> list[dict]:
        item, events = self._open, []
        if item is None:
            return events
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._item_event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]))
            events.append(self._item_event("response.content_part.done", content_index=0, part=dict(part)))
        else:
            events.append(self._item_event("response.function_call_arguments.done", arguments=item["arguments"],
                                           name=item["name"]))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=len(self.output) - 1,
                                  item=copy.deepcopy(item)))
        self._open = None
        return events

    def _pieces(self, pieces: list[Piece]) -> list[dict]:
        events: list[dict] = []
        for p in pieces:
            if p.kind == "content":
                if p.text:
                    events += self._content(p.text)
            elif p.kind == "call":
                events += self._call(p)
            else:
                events += self._arguments(p.text)
        return events

    def opening(self) -> list[dict]:
        """``response.created`` and ``response.in_progress`` (status ``in_progress``, no output)."""
        obj = self.response_object("in_progress", None)
        return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]

    def delta(self, text: str) -> list[dict]:
        """The events of the next part of the reply."""
        if self.parser is None:
            return self._content(text) if text else []
        return self._pieces(self.parser.feed(text))

    def close(self, finished: Finished) -> list[dict]:
        """The events that end the output: text the parser held back, the last item done
        (``incomplete`` when the reply was cut), an empty message when there was no item."""
        events = self._pieces(self.parser.finish()) if self.parser is not None else []
        events += self._close("incomplete" if finished.finish_reason is FinishReason.LENGTH else "completed")
        if not self.output:
            events += self._content("") + self._close("completed")
        return events

    def terminal(self, obj: dict) -> dict:
        """``response.completed`` / ``response.incomplete`` carrying the final object."""
        return self._event(f"response.{obj['status']}", response=obj)

    def failed(self, error: APIError) -> dict:
        """``response.failed``: the object with status ``failed`` and ``error`` ``{code, message}``."""
        obj = self.response_object("failed", None)
        obj["error"] = {"code": error.code or "server_error", "message": error.message}
        return self._event("response.failed", response=obj)

    # -- objects --------------------------------------------------------------------------
    def usage(self, finished: Finished) -> dict:
        cached = finished.cached_tokens or 0
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": finished.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + finished.completion_tokens}

    def response_object(self, status: str, finished: Finished | None) -> dict:
        """The response object (OpenAI's field set); ``finished`` None while it is in progress."""
        obj = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "background": False, "completed_at": int(time.time()) if status == "completed" else None,
               "error": None, "incomplete_details": None, "model": self.model,
               "output": copy.deepcopy(self.output) if finished is not None else [], **copy.deepcopy(self.echo),
               "usage": self.usage(finished) if finished is not None else None}
        if status == "incomplete":
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        if finished is not None and self.return_spec_stats:
            obj["spec_stats"] = finished.spec.to_dict() if finished.spec is not None else None
        return obj

    def final(self, finished: Finished) -> dict:
        """The finished response object (after :meth:`close`)."""
        return self.response_object("incomplete" if finished.finish_reason is FinishReason.LENGTH else "completed",
                                    finished)

    def complete(self, text: str, finished: Finished) -> dict:
        """The whole reply's response object (the same steps as streaming, events dropped)."""
        self.delta(text)
        self.close(finished)
        return self.final(finished)


def frame(event: dict) -> bytes:
    """One SSE event: ``event: <type>`` and ``data: <compact json>`` (UTF-8)."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def response_events(stream: EventStream, fmt: ResponseFormatter,
                          finalize: Callable[[dict], Awaitable[dict]]) -> AsyncIterator[bytes]:
    """Streaming: the SSE bytes of the whole response (module docstring). ``finalize`` gets
    the final object before ``response.completed`` is sent (it stores it) and returns what to
    send. Whatever ends the stream, the engine request is closed (aborted if unfinished)."""
    try:
        for event in fmt.opening():
            yield frame(event)
        async for event in stream:
            if isinstance(event, TextDelta):
                for out in fmt.delta(event.text):
                    yield frame(out)
            elif is_normal_finish(event):
                for out in fmt.close(event):
                    yield frame(out)
                yield frame(fmt.terminal(await finalize(fmt.final(event))))
                break
            else:
                yield frame(fmt.failed(failure_error(event)))
                break
        else:
            yield frame(fmt.failed(server_error("The engine ended the request without a result.")))
    except Exception:
        log.exception("error while streaming %s", fmt.id)
        yield frame(fmt.failed(server_error("The server had an error while streaming the response.", "internal_error")))
    finally:
        await stream.aclose()

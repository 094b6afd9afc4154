"""Hermes-style tool calls parsed out of a reply, incrementally (streamed) or whole.

A call in the reply is ``<tool_call>\\n{"name": "<name>", "arguments": {...}}\\n</tool_call>``
(:data:`runtime.interface.TOOL_CALL_OPEN`; whitespace inside the tags is free). The text
outside the tags is the reply's ``content``; no tag ever reaches it. Whitespace next to a
call is dropped, except between two parts of text that a call separates (they keep the
whitespace that followed the call); a reply without calls is its text unchanged.
:class:`ToolCallParser` is fed the reply's text in pieces as they arrive, split anywhere (a
tag, a name, a string escape may straddle two pieces), and returns what can be told so far,
in order (:class:`Piece`):

* content text, except a trailing part that may still turn into ``<tool_call>`` (a prefix
  such as ``"<tool"``) and trailing whitespace — held back until the next piece decides;
* the start of a call, as soon as its name is complete (index, ``call_…`` id, name), then its
  ``arguments`` text in fragments as they arrive (the JSON value exactly as the model wrote
  it, up to its last brace: the object's closing ``}`` and ``</tool_call>`` are not part of it).

A block whose head is not ``{"name": …, "arguments": …`` in that order (only possible
without a grammar: the engine's tool grammars always write it so) is parsed whole once its
``</tool_call>`` arrives; if it is not a JSON object with a string ``name`` it is kept as
content, tags included (it is not a call). At the end (:meth:`ToolCallParser.finish`) a
held-back prefix is released as content, and a call cut before its name was complete
(``max_tokens``) is dropped; one cut inside its arguments keeps the arguments it got.
Streamed and whole replies parse identically (:func:`parse_tool_calls` feeds everything at once).
Source: OpenAI API reference, Chat, ``message.tool_calls`` and the streamed ``delta.tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from runtime.interface import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

OPEN, CLOSE = TOOL_CALL_OPEN, TOOL_CALL_CLOSE
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TEXT, _HEAD_STATE, _ARGS, _TAIL = "text", "head", "args", "tail"


def new_call_id() -> str:
    """``call_`` + 24 random hex characters (OpenAI's ids are ``call_`` + 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Piece:
    """One thing the reply said, in order: ``kind`` is ``"content"`` (``text``), ``"call"`` (a
    call starts: ``index``, ``id``, ``name``) or ``"arguments"`` (``text`` continues the
    arguments of call ``index``)."""

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str = ""


def _held_prefix(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class _JSONValueEnd:
    """Finds where one JSON value ends, fed in pieces (depth and string state carried over)."""

    def __init__(self) -> None:
        self.started = False
        self.kind = ""  # "nested" ({ or [), "string", "literal" (number, true, false, null)
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> tuple[int, int, bool]:
        """``(skip, end, done)``: leading whitespace to drop, then ``text[skip:end]`` belongs to
        the value; ``done`` when the value ended at ``end`` (or broke off: a ``<`` outside a string
        can only be the closing tag of a call whose arguments never closed)."""
        i, skip = 0, 0
        while i < len(text):
            ch = text[i]
            if not self.started:
                if ch.isspace():
                    i += 1
                    skip = i
                    continue
                if ch in ",}]<":
                    return skip, i, True
                self.started = True
                if ch in "{[":
                    self.kind, self.depth = "nested", 1
                elif ch == '"':
                    self.kind, self.in_string = "string", True
                else:
                    self.kind = "literal"
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.kind == "string":
                        return skip, i + 1, True
            elif self.kind == "literal":
                if ch.isspace() or ch in ",}]<":
                    return skip, i, True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return skip, i + 1, True
            elif ch == "<":
                return skip, i, True
            i += 1
        return skip, len(text), False


class ToolCallParser:
    """Incremental parser of one reply (module docstring).

    Args:
        new_id: makes each call's id (:func:`new_call_id`).

    Attributes:
        calls: every call started so far, arguments as far as they arrived.
    """

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.calls: list[ParsedCall] = []
        self._buf = ""
        self._state = _TEXT
        self._spaces = ""  # whitespace held back: emitted before the next text, or dropped next to a call
        self._said = False  # content emitted so far
        self._value = _JSONValueEnd()

    def feed(self, text: str) -> list[Piece]:
        """The pieces that ``text`` (the next part of the reply) decides."""
        self._buf += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The pieces left at the end of the reply (module docstring)."""
        out: list[Piece] = []
        if self._state == _TEXT:
            self._text(out, self._buf)
            if not self.calls:
                self._content(out, self._spaces)
        self._buf, self._state, self._spaces = "", _TEXT, ""
        return out

    # -- pieces ---------------------------------------------------------------------------
    def _content(self, out: list[Piece], text: str) -> None:
        if text:
            out.append(Piece("content", text))
            self._said = True

    def _text(self, out: list[Piece], text: str) -> None:
        """Text outside the tags. Its trailing whitespace is held back; whitespace held before
        its first visible character is emitted unless a call came first and no content yet."""
        core = text.strip()
        if not core:
            self._spaces += text
            return
        lead = self._spaces + text[:len(text) - len(text.lstrip())]
        self._content(out, (lead if self._said or not self.calls else "") + core)
        self._spaces = text[len(text.rstrip()):]

    def _start_call(self, out: list[Piece], name: str) -> None:
        call = ParsedCall(len(self.calls), self.new_id(), name)
        self.calls.append(call)
        out.append(Piece("call", index=call.index, id=call.id, name=name))

    def _arguments(self, out: list[Piece], text: str) -> None:
        if text:
            call = self.calls[-1]
            call.arguments += text
            out.append(Piece("arguments", text, index=call.index))

    # -- the state machine: text → head → arguments → tail → text ------------------------------
    def _step(self, out: list[Piece]) -> bool:
        """Advance once; ``False`` when more text is needed."""
        buf = self._buf
        if self._state == _TEXT:
            at = buf.find(OPEN)
            if at >= 0:
                self._text(out, buf[:at])
                self._spaces = ""  # whitespace before a call: dropped
                self._buf, self._state = buf[at + len(OPEN):], _HEAD_STATE
                return True
            keep = len(buf) - _held_prefix(buf)
            self._text(out, buf[:keep])
            self._buf = buf[keep:]
            return False
        if self._state == _HEAD_STATE:
            m = _HEAD.match(buf)
            if m is not None:
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    name = m.group(1)
                self._start_call(out, name)
                self._buf, self._state, self._value = buf[m.end():], _ARGS, _JSONValueEnd()
                return True
            end = buf.find(CLOSE)
            if end < 0:
                return False
            self._whole_block(out, buf[:end])
            self._buf, self._state = buf[end + len(CLOSE):], _TEXT
            return True
        if self._state == _ARGS:
            skip, end, done = self._value.scan(buf)
            self._arguments(out, buf[skip:end])
            self._buf = buf[end:]
            if done:
                self._state = _TAIL
            return done
        # _TAIL: the rest of the block (the object's "}" and "\n") up to </tool_call>
        end = buf.find(CLOSE)
        if end < 0:
            self._buf = buf[-(len(CLOSE) - 1):]
            return False
        self._buf, self._state = buf[end + len(CLOSE):], _TEXT
        return True

    def _whole_block(self, out: list[Piece], body: str) -> None:
        """A block whose head did not match: a call if it is ``{"name": str, "arguments": …}``
        in any key order, else content (tags included)."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            self._text(out, OPEN + body + CLOSE)
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        self._start_call(out, obj["name"])
        self._arguments(out, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str, list[ParsedCall]]:
    """A whole reply → ``(content, calls)``: the same parse as feeding it in pieces."""
    parser = ToolCallParser(new_id)
    pieces = parser.feed(text) + parser.finish()
    return "".join(p.text for p in pieces if p.kind == "content"), parser.calls

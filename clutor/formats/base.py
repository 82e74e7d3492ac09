"""What a reply parses into, and the stream parser every family's format plugs into.

A reply is text the model wrote: plain content, maybe reasoning (``<think>...</think>``), maybe tool
calls in its family's markup. ``StreamParser.feed(text)`` takes the reply as it streams, in pieces
cut anywhere (inside a marker, inside a JSON string), and returns a ``Delta``: the content, reasoning
and tool-call pieces that became certain. Text that could still turn out to be the start of a marker
is held back until it cannot. Nothing emitted is ever taken back, so the deltas of a stream, joined,
are the whole reply's parse (``Message``), and the server sends them as OpenAI-style deltas as they
come.

A tool call is announced (``CallDelta`` with ``name``) once its name is complete; its arguments (a
JSON object's text) follow in fragments. Formats whose arguments are JSON stream the model's own
text; formats that write one XML element per argument stream the JSON built from them.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Callable, Sequence

__all__ = ["CallDelta", "Delta", "Message", "ToolCall", "StreamParser", "MarkerParser", "CallBody", "Tool",
           "ValueScanner", "new_call_id", "held_suffix", "json_string_end"]

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An id in OpenAI's shape: 'call_' and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(frozen=True)
class Tool:
    """A function the request offers: its name and its parameters' JSON schema (an object schema)."""

    name: str
    parameters: dict = field(default_factory=dict)
    description: str = ""

    def spec(self, key: str) -> dict | None:
        """One argument's schema, a local ``$ref`` ("#/$defs/Name", "#/definitions/Name") followed."""
        props = self.parameters.get("properties") if isinstance(self.parameters, dict) else None
        spec = props.get(key) if isinstance(props, dict) else None
        for _ in range(8):  # (a chain of references; a cycle ends here)
            ref = spec.get("$ref") if isinstance(spec, dict) else None
            if not isinstance(ref, str):
                break
            where, _, name = ref.rpartition("/")
            table = self.parameters.get(where[2:]) if where in ("#/$defs", "#/definitions") else None
            spec = table.get(name.replace("~1", "/").replace("~0", "~")) if isinstance(table, dict) else None
        return spec if isinstance(spec, dict) else None

    def param_type(self, key: str) -> object:
        """The schema 'type' of one argument (None when the schema does not say)."""
        spec = self.spec(key)
        return spec.get("type") if spec is not None else None

    def is_string(self, key: str) -> bool:
        """Whether the argument is written as raw text (XML formats): a string, or nothing known."""
        t = self.param_type(key)
        return t is None or t == "string" or (isinstance(t, list) and "string" in t)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str     # a JSON object's text, as the model wrote it (JSON formats) or built from its parts


@dataclass(frozen=True)
class CallDelta:
    index: int                 # the call's place in the reply (0, 1, ...)
    id: str | None = None      # set on the call's first delta only
    name: str | None = None    # likewise
    arguments: str = ""        # the next fragment of the arguments' text


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def extend(self, other: "Delta") -> "Delta":
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls.extend(other.calls)
        return self


@dataclass
class Message:
    """A whole reply: what the deltas of its stream add up to."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, d: Delta) -> None:
        self.content += d.content
        self.reasoning += d.reasoning
        for c in d.calls:
            if c.name is not None:
                self.tool_calls.append(ToolCall(c.id or new_call_id(), c.name, c.arguments))
            else:
                last = self.tool_calls[c.index]
                self.tool_calls[c.index] = ToolCall(last.id, last.name, last.arguments + c.arguments)


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``markers``."""
    keep = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), keep, -1):
            if text.endswith(m[:n]):
                keep = n
                break
    return keep


class StreamParser:
    """feed(text) -> Delta, as the reply streams; finish() -> the rest once it has ended."""

    def __init__(self):
        self.message = Message()

    def feed(self, text: str) -> Delta:
        d = self._feed(text)
        self.message.add(d)
        return d

    def finish(self) -> Delta:
        d = self._finish()
        self.message.add(d)
        return d

    def _feed(self, text: str) -> Delta:  # pragma: no cover - abstract
        raise NotImplementedError

    def _finish(self) -> Delta:  # pragma: no cover - abstract
        raise NotImplementedError

    def parse(self, text: str) -> Message:
        """The whole reply at once (the same path as streaming it)."""
        self.feed(text)
        self.finish()
        return self.message


# -- the generic parser: content, one reasoning block, tool-call blocks between markers --------------

@dataclass
class CallBody:
    """What a family's body parser makes of a call's text so far."""

    name: str | None = None       # None until the name is complete
    arguments: str = ""           # the arguments' text so far (grows; never shrinks)
    end: int | None = None        # for formats with no closing marker: where in the body the call ended
    calls: list[tuple[str, str]] | None = None  # a body holding several calls (Mistral's JSON array)


# A body parser: (body text so far, final?) -> CallBody. Called again as the body grows.
BodyParser = Callable[[str, bool], CallBody]


@dataclass(frozen=True)
class Opener:
    marker: str                    # text that opens a call
    close: tuple[str, ...] = ()    # texts that close it (none: the body parser finds the end)
    keep: bool = False             # the marker is part of the body (Qwen3-Coder's bare '<function=')


class MarkerParser(StreamParser):
    """Content with optional ``<think>`` reasoning and tool calls between opening/closing markers.

    reasoning: (open, close) texts of the reasoning block, or None when the reply is not split.
    starts_in_reasoning: the prompt ended inside an open reasoning block (the template wrote '<think>').
    openers: the markers that open a tool call (none: tool calls are not parsed, e.g. no tools asked).
    dropped: markers removed from the text wherever they occur outside calls (DeepSeek's
        '<｜tool▁calls▁begin｜>' around its calls).
    body: the family's body parser.
    prefix: content emitted before the reply (with reasoning not split, the prompt's open '<think>').
    new_id: makes each call's id (Mistral's template wants 9 letters or digits).
    keep_unreadable: a block whose call cannot be read (no name in it, or the body parser says it is
        not a call) is given back as content, markers and all, instead of being dropped: the caller
        sees what the model wrote.
    Where two markers start at the same place, the longer wins (Gemma 4's '<|channel>thought' over
    '<|channel>').
    """

    def __init__(self, *, reasoning: tuple[str, str] | None = None, starts_in_reasoning: bool = False,
                 openers: Sequence[Opener] = (), dropped: Sequence[str] = (), body: BodyParser | None = None,
                 prefix: str = "", new_id: Callable[[], str] = new_call_id, keep_unreadable: bool = False):
        super().__init__()
        self.keep_unreadable = keep_unreadable
        self.new_id = new_id
        self.prefix = prefix       # content to emit first (the prompt's open '<think>' when not split)
        self.reasoning = reasoning
        self.openers = tuple(openers)
        self.dropped = tuple(dropped)
        self.body = body
        self.mode = "reasoning" if reasoning and starts_in_reasoning else "content"
        self.pending = ""          # text not yet decided
        self.ws = ""               # content whitespace held back (between calls, after reasoning)
        self.rws = ""              # reasoning whitespace held back (dropped at the block's end)
        self.started_reasoning = False
        self.any_content = False
        self.after_block = self.mode == "reasoning"  # strip the content's leading whitespace next
        self.n_calls = 0
        self.opener: Opener | None = None
        self.call_text = ""        # the open call's body so far
        self.call_sent = CallBody()  # what of the open call has been emitted
        self.call_ids: list[str] = []
        self.call_ws = ""          # the content whitespace held back when the open call began
        self.final = False         # the reply has ended (finish)

    # -- content / reasoning text ------------------------------------------------------------------
    def _content(self, d: Delta, text: str) -> None:
        if not text:
            return
        if self.after_block or self.n_calls:
            # whitespace after a reasoning block or between calls is layout, not content
            text = self.ws + text
            stripped = text.lstrip() if self.after_block else text
            if not stripped.strip():
                self.ws = text if not self.after_block else ""
                return
            self.after_block = False
            text, self.ws = stripped, ""
        self.any_content = self.any_content or bool(text.strip())
        d.content += text

    def _reason(self, d: Delta, text: str) -> None:
        if not text:
            return
        if not self.started_reasoning:
            text = text.lstrip()
            if not text:
                return
            self.started_reasoning = True
        text = self.rws + text
        body = text.rstrip()
        self.rws = text[len(body):]
        d.reasoning += body

    # -- the loop ------------------------------------------------------------------------------------
    def _markers(self) -> list[str]:
        if self.mode == "reasoning":
            return [self.reasoning[1]]
        if self.mode == "call":
            # with no closing marker the body parser alone finds the end (a marker inside its JSON is text)
            return list(self.opener.close)
        out = [o.marker for o in self.openers] + list(self.dropped)
        if self.reasoning and not self.n_calls and not self.any_content and not self.started_reasoning:
            out.append(self.reasoning[0])  # reasoning comes first, or not at all
        return out

    def _feed(self, text: str) -> Delta:
        d = Delta()
        if self.prefix:
            self._content(d, self.prefix)
            self.prefix = ""
        self.pending += text
        while self.pending:
            markers = self._markers()
            hit, pos = None, -1
            for m in markers:
                i = self.pending.find(m)
                if i >= 0 and (pos < 0 or i < pos or (i == pos and len(m) > len(hit))):
                    hit, pos = m, i
            mode = self.mode
            if hit is not None and not self.final and any(len(m) > len(self.pending) - pos and m.startswith(self.pending[pos:])
                                       for m in markers):
                # a longer marker may still be arriving here ('<|channel>' of '<|channel>thought'): wait
                before, self.pending = self.pending[:pos], self.pending[pos:]
                self._text(d, before, final=False)
                if mode == "call" and self.mode != "call":
                    continue
                break
            if hit is None:
                cut = len(self.pending) - held_suffix(self.pending, markers)
                chunk, self.pending = self.pending[:cut], self.pending[cut:]
                self._text(d, chunk, final=False)
                if mode == "call" and self.mode != "call":
                    continue  # the body parser found the call's end; what followed it is pending again
                break
            before, self.pending = self.pending[:pos], self.pending[pos:]
            self._text(d, before, final=False)
            if mode == "call" and self.mode != "call":
                continue  # the call ended before this marker: read the marker again as content
            self.pending = self.pending[len(hit):]
            self._marker(d, hit)
        return d

    def _text(self, d: Delta, text: str, final: bool) -> None:
        if self.mode == "content":
            self._content(d, text)
        elif self.mode == "reasoning":
            self._reason(d, text)
        else:
            self.call_text += text
            self._call_progress(d, final)

    def _marker(self, d: Delta, m: str) -> None:
        if self.mode == "reasoning":  # its closing marker
            self.mode, self.after_block, self.rws = "content", True, ""
            return
        if self.mode == "call":
            self._call_progress(d, final=True)  # its closing marker
            self._end_call(d, m)
            return
        if m in self.dropped:
            return
        if self.reasoning and m == self.reasoning[0]:
            if self.any_content or self.n_calls or self.started_reasoning:
                # the text before it came in the same piece: read it again as the content's, where
                # it is no marker (as it would have been had that text come first)
                self.pending = m + self.pending
            else:
                self.mode = "reasoning"
            return
        opener = next(o for o in self.openers if o.marker == m)
        reset = getattr(self.body, "reset", None)
        if reset is not None:  # a stateful body parser (HermesBody) starts the new call afresh
            reset()
        self.mode, self.opener, self.call_text, self.call_sent = "call", opener, (m if opener.keep else ""), CallBody()
        self.call_ws, self.ws = self.ws, ""

    # -- calls ---------------------------------------------------------------------------------------
    def _call_progress(self, d: Delta, final: bool) -> None:
        body = self.body(self.call_text, final)
        if body.calls is not None:  # several whole calls in one body
            done = len(self.call_sent.calls or [])
            for name, args in body.calls[done:]:
                self._emit_new(d, name, args)
                self.n_calls += 1
            self.call_sent = CallBody(calls=list(body.calls), end=body.end)
            return
        if body.name is None:
            if body.end is not None:
                self.call_sent = CallBody(end=body.end)
                if self.opener.close == ():  # the body says it ended without a call in it
                    rest = self.call_text[body.end:]
                    self.call_text = self.call_text[:body.end]
                    self._end_call(d)
                    self.pending = rest + self.pending
            return
        if self.call_sent.name is None:
            self._emit_new(d, body.name, body.arguments)
        elif len(body.arguments) > len(self.call_sent.arguments):
            d.calls.append(CallDelta(self.n_calls, arguments=body.arguments[len(self.call_sent.arguments):]))
        self.call_sent = body
        if body.end is not None and self.opener.close == ():
            rest = self.call_text[body.end:]
            self._end_call(d)
            self.pending = rest + self.pending

    def _emit_new(self, d: Delta, name: str, args: str) -> None:
        cid = self.new_id()
        self.call_ids.append(cid)
        d.calls.append(CallDelta(self.n_calls, id=cid, name=name, arguments=args))

    def _end_call(self, d: Delta, close: str = "") -> None:
        # a block whose name never became readable: nothing of it was emitted yet; it is dropped, or
        # given back as the content the model wrote (keep_unreadable)
        unread = self.call_sent.calls is None and self.call_sent.name is None
        if not unread and self.call_sent.calls is None:
            self.n_calls += 1
        opener, text = self.opener, self.call_text
        self.mode, self.opener, self.call_text, self.call_sent = "content", None, "", CallBody()
        if unread and self.keep_unreadable:
            self.ws = self.call_ws
            self._content(d, ("" if opener.keep else opener.marker) + text + close)

    def _finish(self) -> Delta:
        d = Delta()
        self.final = True  # no marker can grow any more
        while True:
            d.extend(self._feed(""))
            rest, self.pending = self.pending, ""
            self._text(d, rest, final=True)
            if self.mode == "call":
                self._call_progress(d, final=True)
                if self.mode == "call":
                    self._end_call(d)
            if not self.pending:  # else a call with no closing marker ended inside the text: read what followed
                break
        self.ws = self.rws = ""
        return d


# -- JSON helpers the body parsers share -------------------------------------------------------------

_WS = " \t\r\n"


def json_string_end(s: str, i: int) -> int | None:
    """End index of the JSON string whose opening quote is s[i], or None while it is unfinished."""
    esc = False
    for j in range(i + 1, len(s)):
        ch = s[j]
        if esc:
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == '"':
            return j + 1
    return None


def scan_json_value(s: str, i: int) -> int | None:
    """End index of the JSON value starting at s[i] (after whitespace), or None while it is unfinished.

    Only the structure is followed (brackets, strings, escapes): validity is json.loads' job."""
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    if i >= n:
        return None
    c = s[i]
    if c in "{[":
        return ValueScanner(i).feed(s)
    if c == '"':
        return json_string_end(s, i)
    j = i
    while j < n and s[j] not in _WS + ",}]":
        j += 1
    return j if j < n else None  # a number or literal ends at a delimiter (or at the end of a final text)


class ValueScanner:
    """scan_json_value, incrementally: ``feed(s, upto)`` reads s[pos:upto] and returns the value's end
    once found (the value must start at ``start`` with '{' or '['). Keeps a long argument's stream
    linear: each piece is scanned once."""

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.in_str = self.esc = False
        self.end: int | None = None

    def feed(self, s: str, upto: int | None = None) -> int | None:
        n = len(s) if upto is None else upto
        j = self.pos
        depth, in_str, esc = self.depth, self.in_str, self.esc
        while j < n and self.end is None:
            ch = s[j]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self.end = j + 1
            j += 1
        self.pos, self.depth, self.in_str, self.esc = j, depth, in_str, esc
        return self.end


def json_args_text(raw: str) -> str:
    """A call's arguments as the text to report: the model's own JSON text, stripped."""
    return raw.strip()


def loads_or(text: str, default):
    try:
        return json.loads(text)
    except ValueError:
        return default

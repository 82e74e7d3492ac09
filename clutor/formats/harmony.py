"""gpt-oss's harmony format. The reply (after the prompt's ``<|start|>assistant``) is a run of messages,
each a header, ``<|message|>``, a body, and an end:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The channel says where a body goes: analysis is reasoning, final (and commentary with no recipient) is
content; a recipient ``to=functions.NAME`` (in the header, before or after the channel) makes the body
a call's arguments. Bodies addressed to built-in tools (``to=python``, ``to=browser.search``) are
dropped: the client offered no such function. ``<|call|>`` and ``<|return|>`` end the reply (they are
stop tokens); ``<|end|>`` ends a message.
"""
from __future__ import annotations

import json
import re
from typing import Sequence

from .base import CallDelta, Delta, StreamParser, Tool, held_suffix, new_call_id
from .family import Family, Lit, alternatives, json_rule, object_schema, text_until

__all__ = ["HARMONY", "HarmonyParser"]

MESSAGE, END, CALL, RETURN, START, CHANNEL, CONSTRAIN = ("<|message|>", "<|end|>", "<|call|>", "<|return|>",
                                                        "<|start|>", "<|channel|>", "<|constrain|>")
_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser(StreamParser):
    def __init__(self, tools: dict[str, Tool] | None, split: bool):
        super().__init__()
        self.tools = tools
        self.split = split           # reasoning apart (False: analysis stays in content, markup and all)
        self.pending = ""
        self.in_header = True
        self.header = ""
        self.dest = "content"        # content | reasoning | call | drop
        self.n_calls = 0
        self.call_args = ""          # the open call's arguments so far (emitted)
        self.body = ""               # the open call's body so far
        self.rws = ""
        self.reasoned = False

    def _open(self, d: Delta) -> None:
        header = self.header
        rec = _RECIPIENT.search(header)
        chans = _CHANNEL.findall(header)
        channel = chans[-1] if chans else "final"
        recipient = rec.group(1) if rec else None
        if recipient == "assistant":
            recipient = None
        if recipient is not None and recipient.startswith("functions.") and self.tools is not None:
            self.dest = "call"
            self.body = self.call_args = ""
            d.calls.append(CallDelta(self.n_calls, id=new_call_id(), name=recipient[len("functions."):]))
        elif recipient is not None:
            self.dest = "drop"
        elif channel == "analysis":
            self.dest = "reasoning" if self.split else "content"
            if not self.split:
                d.content += header.replace(START, "").removeprefix("assistant") + MESSAGE
            elif self.reasoned:
                self.rws = "\n"  # between two analysis messages
        else:
            self.dest = "content"

    def _body(self, d: Delta, text: str) -> None:
        if self.dest == "content":
            d.content += text
        elif self.dest == "reasoning":
            if not self.reasoned:
                text = text.lstrip()
                self.reasoned = bool(text)
            text = self.rws + text
            body = text.rstrip()
            self.rws = text[len(body):]
            d.reasoning += body
        elif self.dest == "call":
            self.body += text
            args = self.body.strip()
            if len(args) > len(self.call_args):
                d.calls.append(CallDelta(self.n_calls, arguments=args[len(self.call_args):]))
                self.call_args = args

    def _close(self, d: Delta, marker: str) -> None:
        if self.dest == "call":
            if not self.call_args:
                d.calls.append(CallDelta(self.n_calls, arguments="{}"))
            self.n_calls += 1
        elif self.dest == "reasoning" and not self.split:
            pass
        elif self.dest == "content" and not self.split and marker == END and self._analysis():
            d.content += END
        self.in_header, self.header, self.dest = True, "", "content"

    def _analysis(self) -> bool:
        chans = _CHANNEL.findall(self.header)
        return bool(chans) and chans[-1] == "analysis"

    def _feed(self, text: str) -> Delta:
        d = Delta()
        self.pending += text
        while self.pending:
            if self.in_header:
                i = self.pending.find(MESSAGE)
                if i < 0:
                    break
                self.header += self.pending[:i]
                self.pending = self.pending[i + len(MESSAGE):]
                self.in_header = False
                self._open(d)
                continue
            hits = [(self.pending.find(m), m) for m in _ENDS + (START,)]
            hits = [(i, m) for i, m in hits if i >= 0]
            if not hits:
                cut = len(self.pending) - held_suffix(self.pending, _ENDS + (START,))
                self._body(d, self.pending[:cut])
                self.pending = self.pending[cut:]
                break
            i, m = min(hits)
            self._body(d, self.pending[:i])
            self.pending = self.pending[i + len(m):]
            if m == START:  # a new message without <|end|>: the header starts here
                self._close(d, m)
                continue
            self._close(d, m)
        return d

    def _finish(self) -> Delta:
        d = Delta()
        if self.in_header:
            # a reply with no header at all (a model that writes plain text): content
            text, self.pending = self.header + self.pending, ""
            if text.strip() and CHANNEL not in text and "to=" not in text:
                d.content += text
            return d
        rest, self.pending = self.pending, ""
        self._body(d, rest)
        self._close(d, END)
        return d


class _Harmony(Family):
    name = "harmony"
    markers = (MESSAGE, END, START, CHANNEL, CONSTRAIN)

    def detect(self, template: str) -> bool:
        return CHANNEL in template and MESSAGE in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        return HarmonyParser(tools, split=think is not None)

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        rules = {f"call{k}": (f'" to=functions.{t.name}" {lit(CHANNEL)} "commentary json" {lit(MESSAGE)} '
                              f"{json_rule(object_schema(t))} {lit(CALL)}")
                 for k, t in enumerate(tools)}
        analysis = f'{lit(CHANNEL)} "analysis" {lit(MESSAGE)} ANALYSIS {lit(END)} {lit(START)} "assistant"'
        return (alternatives(rules) + f"\nANALYSIS: {text_until(END)}\nthought: {analysis}\ncalls: thought? call")

    def render_calls(self, calls) -> str:  # the template renders calls itself
        return "".join(f" to=functions.{n}{CHANNEL}commentary json{MESSAGE}{json.dumps(a)}{CALL}" for n, a in calls)


HARMONY = _Harmony()

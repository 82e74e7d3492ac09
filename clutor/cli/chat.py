"""clutor chat MODEL: talk to a model through its chat template.

/exit or Ctrl-D leaves; Ctrl-C stops the current reply and keeps the conversation."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from ..errors import ClutorError
from .common import Formatter, add_model_args, add_sampling_args, model_kwargs, print_stats, sampling_kwargs

PROMPT = "> "


def add_parser(sub):
    p = sub.add_parser("chat", help="interactive chat through the model's chat template", formatter_class=Formatter,
                       description=__doc__, epilog="example:\n  clutor chat qwen3-30b-a3b.gguf --system 'Be brief.'")
    p.add_argument("model", help="GGUF file (first part of a split model)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--no-stats", action="store_true", help="do not print per-reply statistics")
    add_sampling_args(p, temperature=0.7)
    add_model_args(p)
    p.set_defaults(max_tokens=512)
    return p


def history_path() -> Path:
    return Path(os.path.expanduser("~")) / ".clutor" / "history"


def _setup_readline():
    """Line editing and a private history file (directory 0700, file 0600), when a terminal is attached."""
    if not sys.stdin.isatty():
        return None
    try:
        import readline
    except ImportError:
        return None
    path = history_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        path.touch(mode=0o600)
    os.chmod(path, 0o600)
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return lambda: readline.write_history_file(path)


def _read_line() -> str | None:
    """One user turn, or None at end of input. Ctrl-C at the prompt just clears the line."""
    while True:
        try:
            if sys.stdin.isatty():
                return input(PROMPT)
            line = sys.stdin.readline()
            return None if line == "" else line.rstrip("\n")
        except EOFError:
            return None
        except KeyboardInterrupt:
            print("^C", file=sys.stderr)


async def _reply(model, ids: list[int], args, out) -> tuple[str, object]:
    """Stream one assistant reply; Ctrl-C (SIGINT) cancels it and keeps what was said so far."""
    loop = asyncio.get_running_loop()
    parts: list[str] = []
    stats = None
    options = sampling_kwargs(args)
    options["max_tokens"] = min(options["max_tokens"], model.n_ctx - len(ids))  # the rest of the context

    async def stream():
        nonlocal stats
        async for chunk in model.generate(ids, **options):
            if chunk.text:
                parts.append(chunk.text)
                out.write(chunk.text)
                out.flush()
            if chunk.stats:
                stats = chunk.stats

    task = asyncio.ensure_future(stream())
    installed = False
    try:
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / no signals here
        pass
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        out.write(" [stopped]")
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
    out.write("\n")
    out.flush()
    return "".join(parts), stats


def _fit(model, messages: list[dict]) -> list[int] | None:
    """Token ids of the conversation with room for a reply: the oldest turns (never the system message
    or the newest user turn) are dropped from `messages` until it fits; None if even that is too long."""
    from ..model.chat import chat_prompt

    tok = model.tokenizer
    room = max(16, model.n_ctx // 8)  # tokens kept free for the reply
    while True:
        ids = tok.encode(chat_prompt(tok, messages), special=True)
        if len(ids) + room <= model.n_ctx:
            return ids
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            return None
        del messages[first]


async def run(args) -> int:
    from ..model.model import Model

    save_history = _setup_readline()
    async with Model.open(args.model, **model_kwargs(args)) as model:
        messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        print(f"clutor chat: {os.path.basename(args.model)} ({model.config.arch}). /exit or Ctrl-D to leave, "
              "Ctrl-C stops a reply.", file=sys.stderr)
        try:
            while True:
                line = _read_line()
                if line is None or line.strip() == "/exit":
                    break
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line})
                ids = _fit(model, messages)
                if ids is None:
                    messages.pop()
                    print(f"clutor: that message does not fit the {model.n_ctx}-token context (--n-ctx)",
                          file=sys.stderr)
                    continue
                try:
                    reply, stats = await _reply(model, ids, args, sys.stdout)
                except ClutorError as e:  # one bad turn must not end the conversation
                    messages.pop()
                    print(f"clutor: error: {e}", file=sys.stderr)
                    continue
                messages.append({"role": "assistant", "content": reply})
                if stats is not None and not args.no_stats:
                    print_stats(stats)
        finally:
            if save_history:
                save_history()
    return 0

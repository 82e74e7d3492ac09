"""clutor chat MODEL: talk to a model through its chat template.

Commands: /help, /clear (forget the conversation), /save FILE and /load FILE (the messages as JSON),
/exit (or Ctrl-D). Ctrl-C stops the current reply and keeps the conversation; at the prompt it
clears the line. Start a message with // to send a text that begins with /."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from ..errors import ClutorError
from .common import (OutputError, add_command, add_model_args, add_sampling_args, check_sampling_args, model_kwargs, print_stats,
                     read_text_file, sampling_kwargs, warm_kernels, write_out)
from .source import add_model_source

PROMPT = "> "


def add_parser(sub):
    p = add_command(sub, "chat", "interactive chat through the model's chat template", __doc__,
                    "clutor chat qwen3-30b-a3b.gguf --system 'Be brief.'")
    add_model_source(p)
    p.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None, metavar="TEXT",
                   help="the system message")
    p.add_argument("--no-stats", action="store_true", help="do not print per-reply statistics")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the model's")
    add_sampling_args(p, temperature=0.7, max_tokens=512)
    add_model_args(p)
    return p


HELP = """commands:
  /help         this list
  /clear        forget the conversation (the --system message stays)
  /save FILE    write the conversation to FILE (JSON: a list of {"role", "content"})
  /load FILE    replace the conversation with the one in FILE
  /exit         leave (also Ctrl-D)
Ctrl-C stops a reply (what was said is kept); at the prompt it clears the line.
A message starting with // is sent with one / (e.g. //usr is sent as /usr)."""


def history_path() -> Path:
    return Path(os.path.expanduser("~")) / ".clutor" / "history"


def _setup_readline():
    """Line editing and a private history file (directory 0700, file 0600), when a terminal is attached.
    History is a convenience: when it cannot be kept (~/.clutor is a file, HOME is read-only) the chat
    goes on without it, after one line saying why."""
    if not sys.stdin.isatty():
        return None
    try:
        import readline
    except ImportError:
        return None
    path = history_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        if not path.exists():
            path.touch(mode=0o600)
        os.chmod(path, 0o600)
        readline.read_history_file(path)
    except OSError as e:
        print(f"clutor: note: chat history not kept ({path}: {e.strerror or e})", file=sys.stderr)
        return None
    readline.set_history_length(1000)

    def save() -> None:
        try:
            readline.write_history_file(path)
        except OSError as e:
            print(f"clutor: note: chat history not saved ({path}: {e.strerror or e})", file=sys.stderr)

    return save


def _read_line() -> str | None:
    """One user turn, or None at end of input. Ctrl-C at the prompt just clears the line.

    While waiting here SIGINT raises KeyboardInterrupt in input(), whatever handler the event loop
    installed (asyncio.run's would instead cancel the main task, and the next reply would be the one
    stopped by a Ctrl-C typed long before it)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        # The loop's wakeup fd would also record this Ctrl-C, and the loop would deliver it to the
        # reply's SIGINT handler the moment that is installed: detach it while we wait here.
        wakeup = signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread
        previous = None
    try:
        while True:
            try:
                if sys.stdin.isatty():
                    return input(PROMPT)
                line = sys.stdin.readline()
                return None if line == "" else line.rstrip("\n")
            except EOFError:
                if sys.stdin.isatty():
                    print()  # Ctrl-D: leave the shell prompt on a line of its own
                return None
            except KeyboardInterrupt:
                print("^C", file=sys.stderr)
    finally:
        if previous is not None:
            signal.set_wakeup_fd(wakeup)
            signal.signal(signal.SIGINT, previous)


async def _reply(model, ids: list[int], args, out) -> tuple[str, object]:
    """Stream one assistant reply; Ctrl-C (SIGINT) cancels it and keeps what was said so far."""
    loop = asyncio.get_running_loop()
    parts: list[str] = []
    stats = None
    options = sampling_kwargs(args, model.n_ctx)
    options["max_tokens"] = min(options["max_tokens"], model.n_ctx - len(ids))  # the rest of the context

    async def stream():
        nonlocal stats
        async for chunk in model.generate(ids, **options):
            if chunk.text:
                parts.append(chunk.text)
                write_out(chunk.text, out)
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


def _fit(model, messages: list[dict], template: str | None = None,
         template_name: str = "tokenizer.chat_template") -> list[int] | None:
    """Token ids of the conversation with room for a reply: the oldest turns (never the system message
    or the newest user turn) are dropped from `messages` until it fits; None if even that is too long."""
    from ..model.chat import chat_ids

    tok = model.tokenizer
    room = max(16, model.n_ctx // 8)  # tokens kept free for the reply
    while True:
        ids = chat_ids(tok, messages, template=template, name=template_name)
        if len(ids) + room <= model.n_ctx:
            return ids
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            return None
        del messages[first]


def _load(path: str) -> list[dict]:
    try:
        messages = json.loads(read_text_file(path, "conversation"))
    except json.JSONDecodeError as e:
        raise ClutorError(f"{path}: not a saved conversation: invalid JSON ({e.msg})") from None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ClutorError(f'{path}: not a saved conversation: expected a list of {{"role", "content"}} strings')
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _save(path: str, messages: list[dict]) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(messages, f, ensure_ascii=False, indent=1)
            f.write("\n")
    except OSError as e:
        raise ClutorError(f"{path}: cannot save the conversation: {e.strerror or e}") from None


def _command(line: str, messages: list[dict], system: list[dict]) -> bool:
    """Run a /command; False means leave. Failures are reported and the chat goes on."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    try:
        if name in ("/exit", "/quit"):
            return False
        if name in ("/help", "/?"):
            print(HELP, file=sys.stderr)
        elif name == "/clear":
            messages[:] = system
            print("clutor: conversation cleared", file=sys.stderr)
        elif name in ("/save", "/load"):
            if not arg:
                print(f"clutor: {name} needs a file name: {name} FILE", file=sys.stderr)
            elif name == "/save":
                _save(arg, messages)
                print(f"clutor: saved {len(messages)} messages to {arg}", file=sys.stderr)
            else:
                messages[:] = _load(arg)
                print(f"clutor: loaded {len(messages)} messages from {arg}", file=sys.stderr)
        else:
            print(f"clutor: unknown command {name} (/help lists the commands; start with // to send text "
                  "beginning with /)", file=sys.stderr)
    except ClutorError as e:
        print(f"clutor: error: {e}", file=sys.stderr)
    return True


def run(args):
    check_sampling_args(args)
    template = read_text_file(args.chat_template, "chat template") if args.chat_template else None
    warm_kernels()
    return _chat(args, template)


async def _chat(args, template: str | None) -> int:
    from ..model.model import Model

    template_name = args.chat_template or "tokenizer.chat_template"
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # invalid UTF-8 typed or piped in becomes U+FFFD
    async with Model.open(args.model, **model_kwargs(args)) as model:
        save_history = _setup_readline()
        system: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        messages: list[dict] = list(system)
        print(f"clutor chat: {os.path.basename(args.model)} ({model.config.arch}). /help for commands, "
              "/exit or Ctrl-D to leave, Ctrl-C stops a reply.", file=sys.stderr)
        try:
            while True:
                line = _read_line()
                if line is None:
                    break
                if not line.strip():
                    continue
                if line.startswith("/") and not line.startswith("//"):
                    if not _command(line, messages, system):
                        break
                    continue
                if line.startswith("//"):
                    line = line[1:]
                messages.append({"role": "user", "content": line})
                try:
                    ids = _fit(model, messages, template, template_name)
                except ClutorError as e:  # a template that refuses this conversation
                    messages.pop()
                    print(f"clutor: error: {e}", file=sys.stderr)
                    continue
                if ids is None:
                    messages.pop()
                    print(f"clutor: that message does not fit the {model.n_ctx}-token context (-c/--ctx-size)",
                          file=sys.stderr)
                    continue
                try:
                    reply, stats = await _reply(model, ids, args, sys.stdout)
                except OutputError:
                    raise
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

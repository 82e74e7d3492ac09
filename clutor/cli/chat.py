"""clutor chat MODEL: talk to a model through its chat template.

Commands: /help, /clear (forget the conversation), /save FILE and /load FILE (the messages as JSON),
/stats (the last reply's full report), /exit (or Ctrl-D, also during a reply: the chat ends after
it). Ctrl-C stops the current reply and keeps the conversation; at the prompt it clears the line.
Start a message with // to send a text that begins with /. When the conversation outgrows the
context, the oldest turns are dropped, and the chat says so."""
from __future__ import annotations

import asyncio
import contextlib
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
    p.add_argument("--no-stats", action="store_true", help="no statistics line after each reply (/stats still shows the last one)")
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
  /stats        the full report of the last reply (speed, expert cache, disk, memory)
  /exit         leave (also Ctrl-D; during a reply: after it)
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


def _read_line(typed: str = "") -> str | None:
    """One user turn, or None at end of input. Ctrl-C at the prompt just clears the line. ``typed``:
    what was typed during the last reply, put back on the line to edit (with readline).

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
                    with _typed_ahead(typed):
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


@contextlib.contextmanager
def _typed_ahead(text: str):
    """readline shows ``text`` on the next prompt's line, as if typed there."""
    try:
        import readline
    except ImportError:
        readline = None
    if not text or readline is None:
        yield
        return

    def put_back() -> None:
        readline.insert_text(text)
        readline.redisplay()

    readline.set_pre_input_hook(put_back)
    try:
        yield
    finally:
        readline.set_pre_input_hook(None)


class _Keys:
    """The keys typed at the terminal while a reply streams. The line discipline alone would swallow a
    Ctrl-D typed then (readline switches the terminal to raw mode for the next prompt and the end-of-file
    mark is gone), so during a reply the terminal is in cbreak mode without echo and this reads it:
    Ctrl-D ends the chat after the reply, other keys are put back on the next prompt's line. Ctrl-C
    still raises SIGINT (ISIG stays on), which stops the reply."""

    def __init__(self, loop):
        self.loop, self.eof, self.text = loop, False, ""
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None
        self.saved = None

    def __enter__(self):
        if self.fd is None:
            return self
        import termios

        try:
            self.saved = termios.tcgetattr(self.fd)
            raw = termios.tcgetattr(self.fd)
            raw[3] &= ~(termios.ICANON | termios.ECHO)
            raw[6][termios.VMIN], raw[6][termios.VTIME] = 1, 0
            termios.tcsetattr(self.fd, termios.TCSANOW, raw)
            self.loop.add_reader(self.fd, self._read)
        except (OSError, termios.error, NotImplementedError, RuntimeError):
            self._restore()
        return self

    def _read(self) -> None:
        try:
            data = os.read(self.fd, 4096).decode("utf-8", errors="replace")
        except OSError:
            data = "\x04"
        for ch in data:
            if ch == "\x04" or self.eof:
                self.eof = True
            elif ch in ("\x7f", "\b"):
                self.text = self.text[:-1]
            elif ch in ("\r", "\n"):
                pass  # a line typed ahead is put back to edit, not sent unseen
            elif ch.isprintable():
                self.text += ch

    def _restore(self) -> None:
        if self.saved is not None:
            import termios

            with contextlib.suppress(OSError, termios.error):
                termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)
            self.saved = None

    def __exit__(self, *exc):
        if self.fd is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.fd)
            self._restore()


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
         template_name: str = "tokenizer.chat_template") -> tuple[list[int] | None, int]:
    """(token ids of the conversation with room for a reply, messages dropped): the oldest turns (never
    the system message or the newest user turn) are dropped from `messages` until it fits; ids None if
    even that is too long."""
    from ..model.chat import chat_ids

    tok = model.tokenizer
    room = max(16, model.n_ctx // 8)  # tokens kept free for the reply
    dropped = 0
    while True:
        ids = chat_ids(tok, messages, template=template, name=template_name)
        if len(ids) + room <= model.n_ctx:
            return ids, dropped
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            return None, dropped
        del messages[first]
        dropped += 1


def _template_note(model, override: str | None) -> str:
    """Which chat template renders the conversation (a file without one falls back to ChatML)."""
    if override:
        return f"chat template {override} (--chat-template)"
    if model.tokenizer.chat_template:
        return "the file's chat template"
    return ("no chat template in the file: ChatML is used (right for Qwen-style models; --chat-template FILE "
            "gives another)")


def short_stats(stats) -> str:
    """One line per reply; /stats prints the whole report."""
    parts = [f"{stats.generated_tokens} generated, {stats.decode_tps:.1f} tok/s",
             f"prompt {stats.prompt_tokens} tokens" + (f" ({stats.cached_tokens} reused)" if stats.cached_tokens else "")
             + f", {stats.prefill_tps:.0f} tok/s"]
    if stats.io is not None:
        parts.append(f"expert hit rate {stats.io.hit_rate:.0%}")
    if stats.draft_steps:
        parts.append(f"drafts kept {stats.acceptance:.0%}")
    return "[" + " | ".join(parts) + "; /stats for more]"


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


def _command(line: str, messages: list[dict], system: list[dict], last_stats=None) -> bool:
    """Run a /command; False means leave. Failures are reported and the chat goes on."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    try:
        if name in ("/exit", "/quit"):
            return False
        if name in ("/help", "/?"):
            print(HELP, file=sys.stderr)
        elif name == "/stats":
            if last_stats is None:
                print("clutor: no reply yet", file=sys.stderr)
            else:
                print_stats(last_stats)
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
        print(f"clutor chat: {os.path.basename(args.model)} ({model.config.arch}, {model.n_ctx}-token context); "
              f"{_template_note(model, args.chat_template)}. /help for commands, /exit or Ctrl-D to leave, "
              "Ctrl-C stops a reply.", file=sys.stderr)
        last_stats, typed, leaving = None, "", False
        try:
            while not leaving:
                line = _read_line(typed)
                typed = ""
                if line is None:
                    break
                if not line.strip():
                    continue
                if line.startswith("/") and not line.startswith("//"):
                    if not _command(line, messages, system, last_stats):
                        break
                    continue
                if line.startswith("//"):
                    line = line[1:]
                messages.append({"role": "user", "content": line})
                try:
                    ids, dropped = _fit(model, messages, template, template_name)
                except ClutorError as e:  # a template that refuses this conversation
                    messages.pop()
                    print(f"clutor: error: {e}", file=sys.stderr)
                    continue
                if ids is None:
                    messages.pop()
                    print(f"clutor: that message does not fit the {model.n_ctx}-token context (-c/--ctx-size)",
                          file=sys.stderr)
                    continue
                if dropped:
                    print(f"clutor: dropped the {dropped} oldest message{'s' if dropped > 1 else ''} to fit the "
                          f"{model.n_ctx}-token context (-c/--ctx-size for more; /save keeps what is left)",
                          file=sys.stderr)
                try:
                    with _Keys(asyncio.get_running_loop()) as keys:
                        reply, stats = await _reply(model, ids, args, sys.stdout)
                except OutputError:
                    raise
                except ClutorError as e:  # one bad turn must not end the conversation
                    messages.pop()
                    print(f"clutor: error: {e}", file=sys.stderr)
                    continue
                typed, leaving = keys.text, keys.eof
                messages.append({"role": "assistant", "content": reply})
                last_stats = stats if stats is not None else last_stats
                if stats is not None and not args.no_stats:
                    print(short_stats(stats), file=sys.stderr)
        finally:
            if save_history:
                save_history()
    return 0

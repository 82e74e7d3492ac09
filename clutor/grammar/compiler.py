"""Where a grammar meets llguidance's native compiler, and what may reach it.

The compiler recurses over a grammar's rule references and a schema's ``$ref``s and nested
subschemas. A long enough chain of either overflows any thread's stack, and a stack overflow in
native code is a segfault: it takes the whole server with it, for every client. Two defences:

- A grammar is measured before it is compiled (``check``): its size, its Lark rule definitions and
  its JSON-schema nodes (every subschema a chain can pass through is an object, so the count of
  ``{`` bounds any chain of them). Over a bound it is a GrammarError naming the bound.
- Compiling runs on a thread of its own whose stack is large enough for everything within the
  bounds with a wide margin (``run``): in an ordinary 8 MiB thread llguidance 1.9 overflows at
  about 3,000 chained ``$ref``s or 4,000 chained rules; in ``STACK`` bytes 20,000 of either compile.
  The stack is virtual memory: only the pages a compile touches become resident.

The text limit also bounds the time a compile can take (llguidance compiles lazily, in time roughly
linear in the grammar).
"""
from __future__ import annotations

import queue
import re
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

__all__ = ["MAX_TEXT", "MAX_RULES", "MAX_NODES", "STACK", "check", "run"]

MAX_TEXT = 1 << 20    # bytes of grammar text (Lark, after GBNF is converted; schemas embedded in it)
MAX_RULES = 4096      # Lark rule and token definitions
MAX_NODES = 16384     # JSON-schema objects ('{' anywhere in the text counts, conservatively)
STACK = 512 << 20     # the compiler threads' stack: ~8 KB per level of the deepest chain, 16k levels with room
_THREADS = 2          # compiles at once (a compile takes milliseconds; the server tokenises on two threads)

# a rule or token definition: a name at a line's start (after blanks), then ':' (llguidance's Lark
# takes no other form: the name and its colon share a line)
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?[ \t]*:", re.MULTILINE)

T = TypeVar("T")


def check(text: str, what: str) -> None:
    """Refuse (GrammarError) a grammar too large for the compiler to be safe on; ``what`` names it."""
    from .constraint import GrammarError

    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT:
        raise GrammarError(f"{what}: the grammar is {size} bytes; this server compiles at most {MAX_TEXT}")
    rules = sum(1 for _ in _RULE.finditer(text))
    if rules > MAX_RULES:
        raise GrammarError(f"{what}: the grammar defines {rules} rules; this server compiles at most {MAX_RULES}")
    nodes = text.count("{")
    if nodes > MAX_NODES:
        raise GrammarError(f"{what}: the schema has {nodes} objects (subschemas, '$ref's, properties); this server "
                           f"compiles at most {MAX_NODES}")


class _Pool:
    """A few threads with STACK-byte stacks, started once, that run what is handed to them."""

    def __init__(self):
        self._jobs: "queue.SimpleQueue[tuple[Callable, tuple, Future]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False

    def submit(self, fn: Callable[..., T], *args) -> "Future[T]":
        if not self._started:
            self._start()
        f: Future = Future()
        self._jobs.put((fn, args, f))
        return f

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            # threading.stack_size is process-wide for threads started after it: set it only while
            # starting ours (a thread another module starts meanwhile gets a large, lazily-touched stack)
            old = threading.stack_size()
            try:
                threading.stack_size(STACK)
            except (ValueError, RuntimeError):  # pragma: no cover - a platform without settable stacks
                old = None
            try:
                for i in range(_THREADS):
                    threading.Thread(target=self._work, name=f"clutor-grammar-{i}", daemon=True).start()
            finally:
                if old is not None:
                    threading.stack_size(old)
            self._started = True

    def _work(self) -> None:
        while True:
            fn, args, f = self._jobs.get()
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
                f.set_exception(e)


_pool = _Pool()


def run(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a compiler thread (see the module docstring); blocks the calling thread."""
    return _pool.submit(fn, *args).result()

"""The command line's argument parser: llama.cpp's spellings, nothing guessed.

argparse, left alone, guesses: ``--temp`` would match ``--temperature`` by abbreviation, and an
unknown single-dash word is split after its first letter, so llama.cpp's ``-ngl 99`` became
``-n gl`` ("invalid int value: 'gl'") and ``-sys`` became ``-s ys``. Here every option is spelled in
full (the aliases are declared), a single-dash word must be an option exactly as declared (``-n32``
is refused, as llama.cpp refuses it), and a parse error is one ``clutor: error:`` line, exit code 1,
like every other failure of the command."""
from __future__ import annotations

import argparse
import sys

from ..errors import ClutorError

__all__ = ["Parser", "UsageError", "add_llama_cpp_habits"]


class UsageError(ClutorError):
    """The command line itself is wrong (unknown option, bad value); main prints it as one line."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser without abbreviations or glued short options, raising UsageError (one line)
    instead of printing the usage and exiting 2. Sub-command parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (`{self.prog} --help` lists the options)")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self._refuse_unknown_single_dash(args)
        return super().parse_known_args(args, namespace)

    def _refuse_unknown_single_dash(self, args: list[str]) -> None:
        """A word like ``-ngl`` that is not an option of this parser is an error here, not ``-n gl``."""
        known = self._option_string_actions
        for a in args:
            if a == "--":
                return
            if self._subparsers is not None and not a.startswith("-"):
                return  # the sub-command's name: its own parser checks what follows
            if len(a) <= 2 or a[0] != "-" or a[1] == "-" or " " in a:
                continue  # -n, --long, a value with spaces
            if a.split("=", 1)[0] in known or self._negative_number_matcher.match(a):
                continue  # -sys, -p=TEXT, -1, -0.5
            if "-" + a in known:
                hint = f"; did you mean -{a}?"
            elif a[:2] in known and known[a[:2]].nargs != 0 and a[2:3] in "0123456789.":
                # (only a number glued on is surely a value: -ctk is llama.cpp's option, not -c tk)
                hint = f" (for {a[:2]} {a[2:]}, write it so: a value is never glued to its option)"
            else:
                hint = ""
            self.error(f"unknown option {a}{hint}")

    def parse_args(self, args=None, namespace=None):
        """As argparse, but arguments left over are reported by the sub-command's parser (its name, its help)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            sub.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


class _Ignored(argparse.Action):
    """A llama.cpp option that has no meaning in Clutor: accepted, with one note saying why."""

    def __init__(self, option_strings, dest, why: str, **kwargs):
        self.why = why
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"clutor: note: {option_string} ignored: {self.why}", file=sys.stderr)


_CPU = "Clutor computes on the CPU (the dense weights in RAM, the experts streamed from disk)"
# (option strings, nargs, why) as llama.cpp spells them
_IGNORED = (
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), 1, _CPU),
    (("-sm", "--split-mode"), 1, _CPU),
    (("-ts", "--tensor-split"), 1, _CPU),
    (("-mg", "--main-gpu"), 1, _CPU),
    (("-dev", "--device"), 1, _CPU),
    (("-fa", "--flash-attn"), "?", "attention is computed one way here"),
    (("-ub", "--ubatch-size"), 1, "a step's tokens are set by -b/--step-tokens alone"),
    (("--mlock",), 0, "the dense weights are read into memory; experts are meant to leave it"),
    (("--no-mmap",), 0, "experts are read into the expert cache (--io memory maps the file instead)"),
    (("--numa",), 1, "threads are placed by the OS"),
    (("--jinja",), 0, "chat templates are always rendered with Jinja"),
)


def add_llama_cpp_habits(p: argparse.ArgumentParser, *, server: bool = False) -> None:
    """llama.cpp options that mean nothing here, accepted with a note so a llama.cpp command line runs."""
    g = p.add_argument_group("llama.cpp options accepted and ignored (each prints why)")
    names = [n for names, _, _ in _IGNORED for n in names[:1]] + (["-cb", "--metrics"] if server else [])
    p.epilog = (p.epilog or "") + f"\n\nllama.cpp options that mean nothing here are accepted with a note: {', '.join(names)}"
    for names, nargs, why in _IGNORED:
        g.add_argument(*names, nargs=nargs, action=_Ignored, why=why, metavar="X", help=argparse.SUPPRESS)
    if server:
        for names in (("-cb", "--cont-batching"), ("--metrics",)):
            g.add_argument(*names, nargs=0, action=_Ignored, why="always on in clutor serve", help=argparse.SUPPRESS)

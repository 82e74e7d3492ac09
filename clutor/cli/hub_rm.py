"""clutor rm NAME...: delete models from the Hugging Face Hub cache.

OWNER/NAME:QUANT removes that model's files (in every cached revision); OWNER/NAME removes all of
the repo. Files another cached model still uses are kept."""
from __future__ import annotations

import sys

from .common import add_command


def add_parser(sub):
    p = add_command(sub, "rm", "delete models from the Hugging Face Hub cache", __doc__,
                    "clutor rm Qwen/Qwen3-30B-A3B-GGUF:Q8_0", "clutor rm Qwen/Qwen3-30B-A3B-GGUF")
    p.add_argument("names", nargs="+", metavar="OWNER/NAME[:QUANT]", help="as `clutor list` names them")
    return p


def run(args) -> int:
    from .. import hub
    from ..units import format_bytes

    refs = [hub.parse_ref(n) for n in args.names]  # every name checked before anything is deleted
    for ref in refs:
        n, freed = hub.remove(ref)
        print(f"clutor: removed {ref}: {n} file{'s' if n != 1 else ''}, {format_bytes(freed)} freed", file=sys.stderr)
    return 0

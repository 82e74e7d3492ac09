"""clutor list: the GGUF models in the Hugging Face Hub cache (what `clutor pull` and other Hub tools
fetched), with their sizes on disk."""
from __future__ import annotations

import json

from .common import add_command


def add_parser(sub):
    p = add_command(sub, "list", "list the models in the Hugging Face Hub cache", __doc__, "clutor list")
    p.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    return p


def run(args) -> int:
    from .. import hub
    from ..bench.report import format_table
    from ..units import format_bytes

    models = hub.list_cached()
    if args.json:
        print(json.dumps([{"name": m.name, "repo": m.repo, "commit": m.commit, "refs": list(m.refs),
                           "files": list(m.set.files), "bytes": m.set.nbytes, "complete": m.set.complete,
                           "partial_bytes": m.partial_bytes, "path": str(m.path)} for m in models], indent=2))
        return 0
    if not models:
        print(f"no GGUF model in {hub.hub_cache_dir()} (clutor pull OWNER/NAME[:QUANT] downloads one)")
        return 0
    rows = []
    for m in models:
        if not m.set.files:
            rows.append([m.name, format_bytes(m.partial_bytes), "-", "-", "clutor pull again to resume"])
            continue
        files = f"{len(m.set.files)}" + ("" if m.set.complete else f" of {m.set.parts}")
        note = "" if m.set.complete else "  (incomplete: clutor pull again)"
        if m.partial_bytes:
            note += f"  (+{format_bytes(m.partial_bytes)} partial download)"
        rows.append([m.name, format_bytes(m.set.nbytes), files, m.commit[:10] + (f" {','.join(m.refs)}" if m.refs else ""),
                     str(m.path) + note])
    print(format_table(("model", "size", "files", "revision", "path (give it, or the model's name, to any command)"),
                       rows, left=1))
    print(f"\n{len([m for m in models if m.set.files])} models, "
          f"{format_bytes(sum(m.set.nbytes + m.partial_bytes for m in models))} in {hub.hub_cache_dir()}")
    return 0

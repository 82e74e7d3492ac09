"""The speculative-decoding benchmark's three workloads, as text both engines tokenise the same way.

- edit: ~150 tokens of code in the prompt, and the answer asked to repeat it with one change (an agent
  rewriting a file);
- json: records with known keys, the next one to fill in (an agent filling in a schema);
- prose: a slice of the bundled English corpus to continue (nothing to copy from).
"""
from __future__ import annotations

from importlib import resources

__all__ = ["SPEC_WORKLOADS", "spec_prompt"]

SPEC_WORKLOADS = ("edit", "json", "prose")

_CODE = '''def parse_header(data, offset=0):
    magic = data[offset:offset + 4]
    if magic != b"RECD":
        raise ValueError("not a record: bad magic %r" % magic)
    version = int.from_bytes(data[offset + 4:offset + 8], "little")
    count = int.from_bytes(data[offset + 8:offset + 16], "little")
    return version, count
'''

_RECORDS = [
    '{"name": "numpy", "version": "2.1.0", "license": "BSD-3-Clause", "requires_python": ">=3.10", '
    '"homepage": "https://numpy.org"}',
    '{"name": "requests", "version": "2.32.3", "license": "Apache-2.0", "requires_python": ">=3.8", '
    '"homepage": "https://requests.readthedocs.io"}',
]


def spec_prompt(name: str) -> str:
    if name == "edit":
        return "A function:\n\n" + _CODE + "\nThe same function, renamed to read_header:\n\n"
    if name == "json":
        return ("Package records, one JSON object per line, every key present:\n" + "\n".join(_RECORDS) + "\n")
    if name == "prose":
        text = resources.files("clutor").joinpath("data/corpus.txt").read_text(encoding="utf-8")
        start = len(text) // 3
        start = text.index("\n", start) + 1
        return text[start : start + 300]
    raise ValueError(f"unknown workload {name!r}: expected one of {', '.join(SPEC_WORKLOADS)}")

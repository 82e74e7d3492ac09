"""clutor pull OWNER/NAME[:QUANT]: download a GGUF model from the Hugging Face Hub into its cache.

QUANT is a tag in the file name (Q4_K_M, the default, else Q8_0, else the repo's first model) or a
.gguf file's path in the repo; a split model's parts all come. Files already cached are kept, an
interrupted download resumes. HF_TOKEN (gated and private repos), HF_ENDPOINT (a mirror) and
HF_HUB_CACHE (where the cache is) work as for every Hugging Face tool."""
from __future__ import annotations

import sys

from .common import add_command


def add_parser(sub):
    p = add_command(sub, "pull", "download a GGUF model from the Hugging Face Hub", __doc__,
                    "clutor pull Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M",
                    "clutor pull unsloth/Qwen3-30B-A3B-GGUF:Q8_0 && clutor list")
    p.add_argument("name", metavar="OWNER/NAME[:QUANT]", help="the Hub model and the quant to fetch")
    return p


def run(args) -> int:
    from .. import hub

    ref = hub.parse_ref(args.name)
    path = hub.pull(ref)
    print(path)
    print(f"clutor: ready: clutor chat {ref}   |   clutor info {ref}   |   clutor serve {ref}", file=sys.stderr)
    return 0

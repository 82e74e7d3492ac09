"""Where a command's model comes from: a GGUF file (MODEL or -m FILE), or the Hugging Face Hub
(-hf OWNER/NAME[:QUANT], or MODEL written that way), downloaded into the Hub cache the first time."""
from __future__ import annotations

import argparse
import sys

from .parsing import UsageError

__all__ = ["add_model_source", "resolve_model_source"]


def add_model_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a GGUF file (the first part of a split model), or a Hugging Face model OWNER/NAME[:QUANT]")
    g = p.add_argument_group("model (as llama.cpp names it)")
    g.add_argument("-m", "--model", dest="model_file", default=None, metavar="FILE", help="the GGUF file")
    g.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", default=None, metavar="OWNER/NAME[:QUANT]",
                   help="a model on the Hugging Face Hub: downloaded into its cache unless there already "
                        "(QUANT: a tag such as Q4_K_M, the default, or a .gguf file in the repo)")
    g.add_argument("--offline", action="store_true",
                   help="use only the Hub cache, never the network (also HF_HUB_OFFLINE=1)")
    p.set_defaults(_model_source=True)


def resolve_model_source(args) -> None:
    """Set args.model to a local path (pulling a Hub model that is not cached yet) and args.hub_ref to the
    Hub name it came from (None for a file). ``generate -m FILE TEXT``: TEXT is the prompt."""
    from .. import hub

    positional = args.model
    options = [(kind, v) for kind, v in (("file", args.model_file), ("hub", args.hf_repo)) if v is not None]
    if options and positional is not None:
        if hasattr(args, "prompt") and args.prompt is None:
            args.prompt, positional = positional, None
        else:
            raise UsageError("give the model once: as MODEL, -m FILE or -hf OWNER/NAME[:QUANT]")
    if positional is not None:
        options.append(("hub" if hub.looks_like_ref(positional) else "file", positional))
    if len(options) != 1:
        raise UsageError("no model given: MODEL (a GGUF file or OWNER/NAME[:QUANT]), -m FILE or -hf OWNER/NAME[:QUANT]"
                         if not options else "give the model once: as MODEL, -m FILE or -hf OWNER/NAME[:QUANT]")
    kind, value = options[0]
    args.hub_ref = None
    if kind == "file":
        args.model = value
        return
    ref = hub.parse_ref(value)
    path = None if args.offline else hub.find_cached(ref)
    if path is None:
        path = hub.pull(ref, offline=args.offline)
    else:
        print(f"clutor: {ref}: from the Hub cache ({path}); `clutor pull {ref}` looks for a newer one",
              file=sys.stderr)
    args.model, args.hub_ref = str(path), ref

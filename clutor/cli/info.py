"""clutor info MODEL: architecture, dimensions, weight types, and what streaming it costs."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict

from .common import add_command
from .source import add_model_source


def add_parser(sub):
    p = add_command(sub, "info", "describe a GGUF MoE model", __doc__,
                    "clutor info qwen3-30b-a3b-q4_k_m-00001-of-00003.gguf")
    add_model_source(p)
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    return p


def describe(path: str) -> dict:
    """Everything `clutor info` prints, as a dict (also used by tests and other commands)."""
    from ..model.arch import read_arch
    from ..model.gguf import GGUFFile
    from ..model.options import min_budget, window_bytes_per_token
    from ..model import kernels  # whether a kernel runs is decided on this machine (F16 needs F16C)
    from ..model.weight_types import type_name
    from ..model.weights import expert_layout, resident_bytes

    with GGUFFile.open(path) as f:
        arch = read_arch(f)
        cfg = arch.cfg
        layout = expert_layout(f, arch)
        types = Counter()
        type_bytes = Counter()
        kernel: dict[str, bool] = {}  # False: dequantised on every product (slow)
        for t in f.tensors.values():
            types[type_name(t.qtype)] += 1
            type_bytes[type_name(t.qtype)] += t.nbytes
            kernel[type_name(t.qtype)] = kernels.has_kernel(t.qtype)
        dense = resident_bytes(f, arch)
        per_layer = [layout.expert_bytes(l) for l in range(layout.n_layers)]
        from ..model.kv import PAGE, refusal, sizes
        from ..model.options import KV_TYPES

        template = f.metadata.get("tokenizer.chat_template")
        specs = arch.layer_states()
        kv_per_token = {t: sizes(specs, t)[0] // PAGE for t in KV_TYPES
                        if not any(refusal(s, t) for s in specs if s is not None and s.kind != "recurrent")}
        return {
            "path": path,
            "files": list(f.paths),
            "config": asdict(cfg),
            "arch": arch.describe(),
            "tensor_types": {k: {"tensors": types[k], "bytes": type_bytes[k], "kernel": kernel[k]} for k in sorted(types)},
            "dense_bytes": dense,
            "expert_bytes_total": layout.total_bytes,
            "expert_bytes_one": max(per_layer),
            "expert_bytes_per_token_worst": sum(b * cfg.n_expert_used for b in per_layer),
            "min_expert_cache": min_budget(layout, cfg.n_expert_used),
            "suggested_expert_cache": suggestions(layout, cfg.n_expert_used, dense),
            "kv_bytes_per_token": kv_per_token,  # by kv_type, every layer's keys and values for one position
            # a long prompt's window holds this per token (clutor.model.options.window_bytes_per_token)
            "window_bytes_per_token": window_bytes_per_token(cfg.n_embd, cfg.n_expert_used, cfg.n_ff_exp),
            "context_limit": arch.context_limit(),  # the longest -c the file's RoPE scaling reaches
            # per layer: "full", "window N", "latent", "recurrent", or "none" (an FFN-only layer)
            "layer_states": ["none" if s is None else s.kind + (f" {s.window}" if s.window else "") for s in specs],
            "machine": machine_kernels(),
            "chat_format": chat_format(template if isinstance(template, str) else None),
        }


def chat_format(template: str | None) -> dict:
    """The chat format the file's template selects (clutor.formats): its name, whether the file has a
    template at all, and the reasoning tags its replies are split on."""
    from ..formats import family_for, think_tags

    fam = family_for(template)
    return {"template": bool(template), "format": fam.name, "reasoning": list(think_tags(template) or ()) or None}


def machine_kernels() -> dict:
    """Every weight type Clutor reads and how its products run on this machine: "int8" (ggml's
    activation blocks, the default q8 mode), "float" (a float-activation kernel), "blas" (F32), or
    "dequantised per product" (no kernel here: slow)."""
    from ..model import kernels
    from ..model.weight_types import TYPES

    ki = kernels.info()
    how = {}
    for q, t in TYPES.items():
        if not kernels.has_kernel(q):
            how[t.name] = "dequantised per product"
        elif t.kernel == "blas":
            how[t.name] = "blas"
        else:
            how[t.name] = "int8" if t.q8_block and ki.activation_mode == "q8" else "float"
    return {"backend": ki.backend, "activations": ki.activation_mode, "types": how}


def suggestions(layout, top_k: int, dense: int) -> dict[str, int]:
    """Budgets worth trying: shares of all experts, and what this machine's default would pick."""
    from ..model.options import min_budget, resolve_budget

    out = {"minimum": min_budget(layout, top_k)}
    for share in ("25%", "50%", "100%"):
        out[share] = resolve_budget(share, layout, top_k, dense)[0]
    out["default here"] = resolve_budget(None, layout, top_k, dense)[0]
    return out


def _spans(layers) -> str:
    """Layer numbers as runs: [1, 2, 3, 5] -> "1-3, 5"."""
    runs: list[list[int]] = []
    for l in layers:
        if runs and l == runs[-1][1] + 1:
            runs[-1][1] = l
        else:
            runs.append([l, l])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _window_note(states, kinds) -> str:
    """What the bounded-KV layers keep: a sliding window, or (Llama 4's chunked layers) their chunk."""
    windowed = [k for s, k in zip(states, kinds) if s.startswith("window")]
    chunked = windowed.count("chunked")
    parts = ([f"{len(windowed) - chunked} sliding-window layers keep only their window"] if len(windowed) > chunked else []) \
        + ([f"{chunked} chunked layers keep at most one chunk of KV"] if chunked else [])
    return "".join("; " + p for p in parts)


def _kinds(kinds: list[str]) -> str:
    """Layer kinds in order, runs collapsed: "3 linear attention, 1 attention, ... (4 attention, 12 linear
    attention in all)"."""
    runs: list[list] = []
    for k in kinds:
        if runs and runs[-1][1] == k:
            runs[-1][0] += 1
        else:
            runs.append([1, k])
    shown = ", ".join(f"{n} {k}" for n, k in runs[:8]) + (", ..." if len(runs) > 8 else "")
    totals = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return shown + (" (" + ", ".join(f"{n} {k}" for k, n in totals.items()) + " in all)" if len(runs) > len(totals) else "")


def _fmt(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _chat_line(cf: dict) -> str:
    if not cf["template"]:
        return f"no chat template in the file (ChatML; tool calls: {cf['format']})"
    return f"{cf['format']} tool calls" + (f", reasoning in {' ... '.join(cf['reasoning'])}" if cf["reasoning"] else "")


def _machine_line(m: dict) -> str:
    by: dict[str, list[str]] = {}
    for name, how in m["types"].items():
        by.setdefault(how, []).append(name)
    parts = [f"{how} {' '.join(names)}" for how, names in by.items() if how != "dequantised per product"]
    slow = by.get("dequantised per product")
    return (f"this machine    {m['backend']}, every type Clutor reads: " + "; ".join(parts)
            + (f"; no kernel here (dequantised on every product, slow): {' '.join(slow)}" if slow else ""))


def run(args) -> int:
    import json

    d = describe(args.model)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    c, a = d["config"], d["arch"]
    with_kernel = [k for k, v in d["tensor_types"].items() if v["kernel"]]
    without = [k for k, v in d["tensor_types"].items() if not v["kernel"]]
    lines = [
        f"file            {d['path']}" + (f" (+{len(d['files']) - 1} parts)" if len(d["files"]) > 1 else ""),
        f"architecture    {c['arch']}",
        f"layers          {c['n_layers']}" + (f" ({a['dense_layers']} dense " + ("interleaved" if a.get("dense_interleaved")
                                                                          else "first") + f"): MoE in {_spans(c['moe_layers'])}"
                                              if a["dense_layers"] and c["moe_layers"] else ""),
        f"embedding       {c['n_embd']}",
        f"heads           {c['n_head']} q / {c['n_head_kv']} kv, head dim {c['head_dim']}",
        f"attention       {a['attention']}, RoPE {a['rope']}"
        + (f", sliding window {a['sliding_window']}" if a["sliding_window"] else ""),
        f"layer kinds     {_kinds(a['layer_kinds'])}",
        "KV cache        " + ", ".join(f"{_fmt(n)} per token as {t}" + (" (default)" if t == "f16" else "")
                                   for t, n in d["kv_bytes_per_token"].items())
        + (f" in {len(c['kv_layers'])} of {c['n_layers']} layers" if c.get("kv_layers") is not None else "")
        + _window_note(d["layer_states"], a["layer_kinds"]),
        (f"recurrent state {_fmt(a['recurrent_bytes'])} per sequence (float32, fixed: conv + "
         f"{'SSM' if 'SSM' in a['layer_kinds'] else 'delta-rule'} states, whatever the context)")
        if a.get("recurrent_bytes") else "",
        (f"prompt window   {_fmt(d['window_bytes_per_token'])} of memory per token: a prompt of N tokens reads "
         f"each expert once per layer where N x that fits half the memory left (--prefill-window)")
        if not a.get("recurrent_bytes") else "prompt window   off: recurrent layers prefill in chunks of --step-tokens",
        f"gating          {a['gating']}",
        f"vocabulary      {c['n_vocab']}",
        f"chat format     {_chat_line(d['chat_format'])}",
        f"context         {c['n_ctx_train']} (the default -c where memory holds one sequence's KV at it)"
        + (f"; YaRN reaches {d['context_limit']}" if d["context_limit"] > c["n_ctx_train"] else ""),
        f"experts         {c['n_expert']}, top-{c['n_expert_used']}, hidden {c['n_ff_exp']}"
        + (f", shared expert hidden {c['n_ff_shexp']}" if c["n_ff_shexp"] else "")
        + (", gate+up fused in one tensor" if a.get("fused_gate_up") else "")
        + (f"; {a['mtp_layers_skipped']} MTP layers skipped" if a.get("mtp_layers_skipped") else ""),
        "weight types    " + ", ".join(f"{k} x{v['tensors']} ({_fmt(v['bytes'])})" for k, v in d["tensor_types"].items()),
        "kernels         " + (", ".join(with_kernel) or "none")
        + (f"; no kernel for {', '.join(without)}: dequantised on every product (slow)" if without else ""),
        _machine_line(d["machine"]),
        f"dense bytes     {_fmt(d['dense_bytes'])} (resident)",
        f"expert bytes    {_fmt(d['expert_bytes_total'])} in all, {_fmt(d['expert_bytes_one'])} per expert",
        f"read per token  {_fmt(d['expert_bytes_per_token_worst'])} at worst (every routed expert a miss)",
        f"minimum cache   {_fmt(d['min_expert_cache'])} (one layer's top-{c['n_expert_used']})",
        "suggested       " + ", ".join(f"{k}: {_fmt(v)}" for k, v in d["suggested_expert_cache"].items())
        + "  (--expert-cache; more cache, fewer reads)",
    ]
    print("\n".join(line for line in lines if line))
    return 0

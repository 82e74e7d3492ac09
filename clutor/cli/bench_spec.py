"""`clutor bench MODEL --speculative [--model-draft DRAFT]`: decoding with n-gram drafts (and with the
draft model) against decoding without, on three workloads (clutor.bench.spec_workloads: an edit, JSON
filling, prose), in RAM and streamed under a memory cap, beside llama.cpp's prompt-lookup decoding (and
llama-server with the same draft model) on the same files and prompt ids. Under a cap, a draft model's
file size is added to the cap: it runs in RAM beside the target, in both engines.

Every row is a fresh process (clutor.bench.spec_worker). Greedy, end-of-generation ignored. A row shows
decode tok/s, drafts kept / drafted, expert MiB read per generated token (streamed), and for a streamed
row its disk bound: fio's bandwidth over the bytes the row read per token.
"""
from __future__ import annotations

import json
import sys

from ..bench.spec_workloads import SPEC_WORKLOADS

__all__ = ["run_speculative", "render_speculative"]


def _say(msg: str, end: str = "\n") -> None:
    print(msg, end=end, file=sys.stderr, flush=True)


def run_speculative(args, report: dict, plan) -> int:
    """The rows (report["speculative"]); plan: (cap bytes, Budget) for the streamed rows, or None."""
    from ..bench.runner import Budget, preload, run_worker

    import os

    draft = getattr(args, "model_draft", None)
    modes = ["off", "ngram"] + (["model"] if draft else [])
    settings = [("in RAM", {"io": "memory"}, None)]
    if args.io != "memory":
        budget = plan[1] if plan else (args.budgets[0] if args.budgets else Budget("25%", fraction=0.25))
        cap = plan[0] + (os.path.getsize(draft) if plan and draft else 0) if plan else None
        settings.append((f"streamed, expert cache {budget.text}" + (f", cap {_gib(cap)}" if cap else ""),
                         {"io": args.io, "expert_cache": budget.worker_value}, cap))
    engines = ["clutor"] + (["llama.cpp"] if args.vs_llama_cpp else [])
    rows = []
    total = len(settings) * len(SPEC_WORKLOADS) * len(engines) * len(modes)
    k = 0
    for name, opts, cap in settings:
        if cap is None:
            preload(args.model)
        for wl in SPEC_WORKLOADS:
            for engine in engines:
                for mode in modes:
                    k += 1
                    _say(f"[{k}/{total}] {engine} {name}, {wl}, drafts {mode} ... ", end="")
                    wargs = {"engine": engine, "workload": wl, "draft": mode, "tokens": args.tokens,
                             "activations": args.activations, "draft_model": draft}
                    if engine == "clutor":
                        wargs.update(opts)
                    elif cap is not None:
                        wargs["extra_buffers"] = False  # its weights as file pages: what a cap below the file allows
                    o = run_worker(args.model, "speculative", wargs, cap=cap, drop_caches=cap is not None,
                                   timeout=args.timeout)
                    _say(f"{o.result['decode_tps']:.3g} tok/s" if o.ok else f"error: {o.error}")
                    rows.append({**o.to_json(), "setting": name, "workload": wl, "engine": engine, "draft": mode,
                                 "streamed": opts.get("io") != "memory"})
    report["speculative"] = rows
    print(json.dumps(report, indent=2) if args.json else render_speculative(report))
    return 0 if all(r["ok"] for r in rows) else 1


def _gib(n: int) -> str:
    from ..units import format_bytes

    return format_bytes(n)


def render_speculative(report: dict) -> str:
    bps = report.get("disk", {}).get("bytes_per_second") or 0
    draft = report["settings"].get("model_draft")
    out = [f"model {report['model']['path']} ({report['model']['arch']}), greedy, "
           f"{report['settings']['tokens']} tokens" + (f", fio {bps / (1 << 30):.2f} GiB/s" if bps else "")
           + (f"; drafts 'model': {draft}" if draft else "")]
    rows = report["speculative"]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        out += ["", f"## {setting}", "",
                "| workload | engine | drafts | tok/s | x no drafts | kept / drafted | steps drafted | "
                "expert MiB / token | disk bound tok/s | same tokens |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in (r for r in rows if r["setting"] == setting):
            res = r["result"] or {}
            mode = _shown_mode(r["draft"])
            if not r["ok"]:
                out.append(f"| {r['workload']} | {r['engine']} | {mode} | error: "
                           f"{r['error']} | | | | | | |")
                continue
            base = next((q["result"] for q in rows if q["setting"] == setting and q["workload"] == r["workload"]
                         and q["engine"] == r["engine"] and _shown_mode(q["draft"]) == "off" and q["ok"]), None)
            ratio = f"{res['decode_tps'] / base['decode_tps']:.2f}x" if base and base["decode_tps"] else "-"
            same = "-"
            on = mode != "off"
            if base is not None and on:
                same = "yes" if (res.get("tokens") or res.get("text")) == (base.get("tokens") or base.get("text")) else "NO"
            kept = (f"{res['accepted']} / {res['drafted']}" if "drafted" in res and on else "-")
            steps = str(res.get("draft_steps", "-")) if on and "draft_steps" in res else "-"
            per = res.get("decode_bytes", 0) / max(1, len(res.get("tokens") or [0, 0]) - 1)
            mib = f"{per / (1 << 20):.1f}" if r["streamed"] and r["engine"] == "clutor" else "-"
            bound = f"{bps / per:.3g}" if r["streamed"] and r["engine"] == "clutor" and per and bps else "-"
            out.append(f"| {r['workload']} | {r['engine']} | {mode} | "
                       f"{res['decode_tps']:.3g} | {ratio} | {kept} | {steps} | {mib} | {bound} | {same} |")
    return "\n".join(out)


def _shown_mode(draft) -> str:
    """A row's drafts: off / ngram / model (reports of earlier versions say True / False)."""
    return "ngram" if draft is True else "off" if not draft else str(draft)

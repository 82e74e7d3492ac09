#!/usr/bin/env python3
"""Where a streamed decode token's time goes: a timeline of the compute thread's spans and the expert reads.

    python tools/timeline.py MODEL.gguf [--budget 25%] [--tokens 48] [--prompt-tokens 32] [--show 2]
                             [--streams 4] [--disk-mibs 1135 | --fio-seconds 3] [--json OUT.json]

One stream (or --streams N at once, their decode steps batched: each stream's prompt and seed as the
bench's --concurrency gives them), the bench's text workload (its prompts and sampler), the library's defaults otherwise
(prefetch auto, lrfu unless --policy). A diagnostic, not a benchmark: it wraps the runner's compute-thread functions and
the store's submit/finish/reserve with timestamps (a few microseconds each), runs the generation, then
for each decode token (the first two skipped) splits its wall time into:

    compute        the compute thread busy (attention, router, experts, output head, sampling)
    read wait      the compute thread idle while a demand read was in flight
    hand-off       the compute thread outside those spans with no demand read in flight: the store's
                   reservation (take), the step's glue, thread wake-ups

and where the disk idled: the time any read (demand or prefetch) was in flight, the bandwidth the reads
got meanwhile (the disk's speed in this run, next to fio's), and the time no read was in flight split by
what the compute thread did then (a layer's attention, experts, the output head, nothing): what a read
started earlier could fill. It also prints the dependency bound of the run's own misses (at fio's
bandwidth, and at the bandwidth the reads got in this run): the compute, plus for every layer's get the
part of its misses' reads (at the disk's bandwidth) that the layer's cached experts' compute cannot
cover, max(0, misses x expert bytes / bandwidth - cached experts x compute per expert). A layer's
experts are known only once its router has run on the layer before's output, so a miss that no
prediction caught can overlap nothing else: this is the fastest the pipeline could run on these
misses, without fewer of them (a better policy, a better prediction).

--show N prints the first N tokens' events (ms from the step's start): ls = a layer's attention and
router (and the sum of the layer before), eo = an expert group's products, fin = the last
layer's sum, output head and sampling, get = the store reserving a layer's experts (wanted, misses),
sub / done = a batch of reads submitted / one expert's reads over (demand or prefetch).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # (as the clutor command sets it)

import numpy as np  # noqa: E402

from clutor.bench.prompt import sampling_options, workload_prompts  # noqa: E402
from clutor.io import store as store_mod  # noqa: E402
from clutor.model import runner as runner_mod  # noqa: E402
from clutor.model.model import Model  # noqa: E402

_now = time.perf_counter


class Recorder:
    """(kind, start, end, info) events from wrapped methods; restores them on exit."""

    def __init__(self):
        self.events: list[tuple] = []
        self._undo: list[tuple] = []
        self._submitted: dict[int, tuple[float, bool]] = {}

    def _wrap(self, cls, name, make):
        orig = getattr(cls, name)
        self._undo.append((cls, name, orig))
        setattr(cls, name, make(orig))

    def __enter__(self):
        ev, sub = self.events, self._submitted

        def timed(kind, info=None):
            def make(orig):
                def f(self_, *a, **k):
                    t0 = _now()
                    try:
                        return orig(self_, *a, **k)
                    finally:
                        ev.append((kind, t0, _now(), info(*a) if info else None))
                return f
            return make

        def timed_layer_start(orig):  # a generator (it pauses between a long step's tiles): its whole run
            def f(self_, l, *a):
                t0 = _now()
                try:
                    return (yield from orig(self_, l, *a))
                finally:
                    ev.append(("ls", t0, _now(), l))
            return f

        self._wrap(runner_mod.Runner, "_layer_start", timed_layer_start)
        self._wrap(runner_mod.Runner, "_experts_out", timed("eo", lambda l, h, sel, w, views, step: (l, [v.expert for v in views])))
        self._wrap(runner_mod.Runner, "_finish", timed("fin"))

        def submit(orig):
            def f(self_, loads, demand):
                t = _now()
                for load in loads:
                    sub[id(load)] = (t, demand)
                ev.append(("sub", t, t, (demand, [list(load.key) for load in loads])))
                return orig(self_, loads, demand)
            return f

        def finish(orig):
            def f(self_, load):
                t, demand = sub.pop(id(load), (_now(), None))
                ev.append(("done", t, _now(), (list(load.key), demand is True or not load.prefetch)))
                return orig(self_, load)
            return f

        def begin(orig):  # a take's reservation: (layer, experts asked, misses), None while it must wait
            def f(self_, layer, experts, keys, wake):
                t0 = _now()
                out = orig(self_, layer, experts, keys, wake)
                if out is not None:
                    ev.append(("get", t0, _now(), (layer, [int(e) for e in experts], sorted(k[1] for k in out[1].keys))))
                return out
            return f

        def run_now(orig):  # every step (from run, or a lone generation's run_solo)
            def f(self_, plan):
                t0 = _now()
                try:
                    return orig(self_, plan)
                finally:
                    ev.append(("run", t0, _now(), bool(plan.decode)))
            return f

        self._wrap(store_mod.ExpertStore, "_submit", submit)
        self._wrap(store_mod.ExpertStore, "_finish", finish)
        self._wrap(store_mod.ExpertStore, "_try_begin", begin)
        self._wrap(runner_mod.Runner, "run_now", run_now)
        # io=memory: a layer's routed experts are one call (the resident table, or the general path inside it)
        self._wrap(runner_mod.Runner, "_routed_now",
                   timed("eo", lambda l, h, sel, w, step: (l, list(dict.fromkeys(sel.reshape(-1).tolist())))))
        return self

    def __exit__(self, *exc):
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)


def _union(intervals, lo, hi) -> float:
    """Length of the union of (a, b) intervals clipped to [lo, hi]."""
    total, cur = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        a = max(a, cur)
        if b > a:
            total, cur = total + b - a, b
    return total


def analyse(events: list[tuple], expert_bytes: int, disk_bps: float | None, skip: int = 2) -> dict:
    steps = [e for e in events if e[0] == "run" and e[3]][skip:]
    spans = [(e[1], e[2]) for e in events if e[0] in ("ls", "eo", "fin")]
    demand = [(e[1], e[2]) for e in events if e[0] == "done" and e[3][1]]
    experts = [e for e in events if e[0] == "eo"]
    per_expert = sum(e[2] - e[1] for e in experts) / max(1, sum(len(e[3][1]) for e in experts))
    reads = [(e[1], e[2]) for e in events if e[0] == "done"]  # every expert's reads, demand or prefetch
    cpu = [e for e in events if e[0] in ("ls", "eo", "fin")]
    idle_by: dict[str, float] = {}
    by_layer: dict[int, dict[str, float]] = {}  # layer -> {"wait": s, "misses": n}, summed over the steps
    rows = []
    for _, r0, r1, _ in steps:
        busy = _union(spans, r0, r1)
        idle = [(a, b) for a, b in _gaps(spans, r0, r1)]
        gets = [e for e in events if e[0] == "get" and r0 <= e[1] <= r1]
        waiting = 0.0
        for a, b in idle:
            w = _union(demand, a, b)
            waiting += w
            before = [g for g in gets if g[1] < b]  # a wait belongs to the last layer to ask before it ended
            if w and before:
                d = by_layer.setdefault(before[-1][3][0], {"wait": 0.0, "misses": 0.0})
                d["wait"] += w
        for g in gets:
            by_layer.setdefault(g[3][0], {"wait": 0.0, "misses": 0.0})["misses"] += len(g[3][2])
        misses = sum(len(g[3][2]) for g in gets)
        dep = None
        if disk_bps:
            dep = busy + sum(max(0.0, len(g[3][2]) * expert_bytes / disk_bps
                                 - (len(g[3][1]) - len(g[3][2])) * per_expert) for g in gets)
        disk = _union(reads, r0, r1)
        n_read = sum(1 for a, b in reads if r0 < b <= r1)
        rows.append({"wall": r1 - r0, "compute": busy, "read_wait": waiting, "handoff": (r1 - r0) - busy - waiting,
                     "misses": misses, "dependency_bound": dep, "disk_busy": disk, "reads": n_read})
        for what, t in _disk_idle_by(reads, cpu, r0, r1).items():
            idle_by[what] = idle_by.get(what, 0.0) + t
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if rows[0][k] is not None} if rows else {}
    disk_total = sum(r["disk_busy"] for r in rows)
    lat = [e[2] - e[1] for e in events if e[0] == "done" and e[3][1]]
    return {"tokens": len(rows), "mean": mean, "per_expert_compute": per_expert,
            "demand_read_ms": {"n": len(lat), "p50": 1e3 * float(np.median(lat)) if lat else None,
                               "mean": 1e3 * float(np.mean(lat)) if lat else None},
            "disk_bytes_per_second": disk_bps, "expert_bytes": expert_bytes,
            # the disk's own speed in the run: bytes of the experts read over the time any read was in flight
            "busy_bytes_per_second": sum(r["reads"] for r in rows) * expert_bytes / disk_total if disk_total else None,
            "disk_idle_by": {k: v / len(rows) for k, v in sorted(idle_by.items(), key=lambda kv: -kv[1])},
            # per token: each MoE layer's misses and the read wait after its get
            "by_layer": {l: {k: v / len(rows) for k, v in d.items()} for l, d in sorted(by_layer.items())} if rows else {}}


def _disk_idle_by(reads, cpu, r0, r1) -> dict[str, float]:
    """The step's time with no read in flight, split by what the compute thread did meanwhile:
    "attention L" (layer L's attention and router), "output" (the last layer's sum, the head and
    sampling), "experts" (the expert groups' products) or "nothing"; seconds. A group recorded inside an
    attention or output span counts for that span, so the parts add up to the idle time."""
    out: dict[str, float] = {}
    # reads clipped to the step (a prefetch may start in the step before)
    for a, b in _gaps([(max(a, r0), min(b, r1)) for a, b in reads if b > r0 and a < r1], r0, r1):
        near = [e for e in cpu if e[2] > a and e[1] < b]
        trips = [(e[1], e[2]) for e in near if e[0] != "eo"]  # attention and output trips: never overlap
        for e in near:
            if e[0] != "eo":
                what = f"attention L{e[3]}" if e[0] == "ls" else "output"
                out[what] = out.get(what, 0.0) + min(b, e[2]) - max(a, e[1])
        every = _union([(e[1], e[2]) for e in near], a, b)
        groups = every - _union(trips, a, b)
        if groups > 0:
            out["experts"] = out.get("experts", 0.0) + groups
        out["nothing"] = out.get("nothing", 0.0) + (b - a) - every
    return out


def _gaps(spans, r0, r1):
    cur = r0
    for a, b in sorted((a, b) for a, b in spans if r0 <= a <= r1):
        if a > cur:
            yield cur, a
        cur = max(cur, b)
    if r1 > cur:
        yield cur, r1


def show(events: list[tuple], n: int, skip: int = 2) -> None:
    steps = [e for e in events if e[0] == "run" and e[3]][skip:skip + n]
    for k, (_, r0, r1, _) in enumerate(steps):
        print(f"--- decode token {k + skip}: {1e3 * (r1 - r0):.1f} ms")
        for e in sorted((e for e in events if e[0] != "run" and r0 <= e[1] <= r1), key=lambda e: e[1]):
            print(f"  {1e3 * (e[1] - r0):7.2f} -> {1e3 * (e[2] - r0):7.2f}  {e[0]:4s} {e[3] if e[3] is not None else ''}")


async def _generate(path: str, budget: str, policy: str | None, io: str, tokens: int, prompt_tokens: int,
                    rec: Recorder, streams: int = 1) -> int:
    opts = {"io": io} if io == "memory" else {"io": io, "expert_cache": budget, **({"policy": policy} if policy else {})}
    async with Model.open(path, **opts) as model:
        *prompts, warm = workload_prompts(model.tokenizer, "text", streams + 1, prompt_tokens, 0)
        async for _ in model.generate(warm, max_tokens=1, ignore_eos=True, **sampling_options("text", 0)):
            pass

        async def one(i: int, prompt) -> None:  # each stream seeded as the bench seeds it
            async for _ in model.generate(prompt, max_tokens=tokens, ignore_eos=True, **sampling_options("text", i)):
                pass

        with rec:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        stats = model.io_stats()
        return int(stats.slot_bytes) if stats is not None else 0  # one expert's read, widened to O_DIRECT alignment


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--budget", default="25%")
    p.add_argument("--policy", default=None, help="cache policy (default: the library's)")
    p.add_argument("--io", default="auto", help="auto | uring | threads | memory (the file mapped: the compute alone)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--streams", type=int, default=1, help="generations at once (their decode steps batched)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--show", type=int, default=0, help="print the first N decode tokens' events")
    p.add_argument("--disk-mibs", type=float, default=None, help="disk bandwidth for the dependency bound, MiB/s")
    p.add_argument("--fio-seconds", type=float, default=3.0, help="else measure it with fio first (0: no bound)")
    p.add_argument("--json", default=None, help="also write the events and the summary here")
    a = p.parse_args(argv)
    bps = a.disk_mibs * 2**20 if a.disk_mibs else None
    if bps is None and a.fio_seconds > 0:
        from clutor.bench.runner import disk_bandwidth

        bps = disk_bandwidth(a.model, a.fio_seconds).bytes_per_second
    rec = Recorder()
    expert_bytes = asyncio.run(_generate(a.model, a.budget, a.policy, a.io, a.tokens, a.prompt_tokens, rec,
                                            a.streams))
    if a.show:
        show(rec.events, a.show)
    s = analyse(rec.events, expert_bytes, bps)
    m = s["mean"]
    print(f"{s['tokens']} decode tokens, ms per token: wall {1e3 * m['wall']:.1f} = compute {1e3 * m['compute']:.1f}"
          f" (experts {1e3 * s['per_expert_compute']:.2f} ms each)"
          f" + read wait {1e3 * m['read_wait']:.1f} + hand-off {1e3 * m['handoff']:.1f}; {m['misses']:.2f} misses/token;"
          + (f" demand reads p50 {s['demand_read_ms']['p50']:.1f} ms" if s["demand_read_ms"]["n"] else ""))
    if s["by_layer"]:
        print("read wait by layer, ms per token (misses per token): " + ", ".join(
            f"L{l} {1e3 * d['wait']:.1f} ({d['misses']:.2f})" for l, d in s["by_layer"].items()))
    if m.get("dependency_bound") and expert_bytes:
        print(f"dependency bound on these misses at {bps / 2**20:.0f} MiB/s: {1e3 * m['dependency_bound']:.1f} ms/token"
              f" ({m['dependency_bound'] / m['wall']:.2f} of the wall time); compute alone {1e3 * m['compute']:.1f}")
    if s["busy_bytes_per_second"]:
        # The same bound at the speed the reads got in this run (fio's sample is another minute's disk).
        own = analyse(rec.events, expert_bytes, s["busy_bytes_per_second"])["mean"]["dependency_bound"]
        print(f"dependency bound at this run's {s['busy_bytes_per_second'] / 2**20:.0f} MiB/s while busy:"
              f" {1e3 * own:.1f} ms/token ({own / m['wall']:.2f} of the wall time)")
        idle = ", ".join(f"{what} {1e3 * t:.1f}" for what, t in s["disk_idle_by"].items())
        print(f"disk busy {1e3 * m['disk_busy']:.1f} ms/token ({m['disk_busy'] / m['wall']:.2f} of the wall time) at"
              f" {s['busy_bytes_per_second'] / 2**20:.0f} MiB/s while busy, {m['reads']:.2f} experts read/token;"
              f" idle {1e3 * (m['wall'] - m['disk_busy']):.1f} ms/token, the compute thread meanwhile in: {idle}")
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": s, "events": rec.events}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

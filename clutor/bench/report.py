"""The tables ``clutor bench`` prints, rendered from its JSON report (so ``--json`` output can be re-read).

Report layout (what clutor.cli.bench builds):
    {"model": {...}, "settings": {...}, "disk": {"bytes_per_second", "note"},
     "sweep": [{"budget", "cache_bytes", "prefetch", "policy", **RunOutcome.to_json()}, ...],
     "comparison": None | {"rows": [{"setting", "cap", "clutor_config", "clutor": outcome, "llama": outcome}],
                           "notes": [...]}}
"""
from __future__ import annotations

from typing import Sequence

from ..model.profile import from_json, render as render_profile
from ..units import format_bytes
from .prompt import WARMUP_PROMPT_TOKENS

__all__ = ["render_report", "render_concurrency", "render_sweep", "render_comparison", "format_table", "decode_read_per_token",
           "disk_limit_tps"]


# ---- small formatters ------------------------------------------------------------------------

def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    r = a / b
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _onoff(v) -> str:
    return {True: "on", False: "off", None: "auto"}.get(v, str(v))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """Aligned columns: the first ``left`` columns left-aligned (labels), the rest right-aligned (figures).
    A row with fewer cells than headers lets its last cell run on (error messages)."""
    widths = [len(h) for h in headers]
    for r in rows:
        cells = r if len(r) == len(headers) else r[:-1]  # a run-on last cell does not widen its column
        widths = [max(w, len(c)) for w, c in zip(widths, cells)] + widths[len(cells):]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            if i == len(cells) - 1 and len(cells) < len(headers):
                out.append(c)
            else:
                out.append(c.ljust(widths[i]) if i < left else c.rjust(widths[i]))
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


# ---- derived figures -------------------------------------------------------------------------

def _io(result: dict | None) -> dict:
    return (result or {}).get("io") or {}


def decode_read_per_token(result: dict | None, *, prefer_engine: bool = True) -> float | None:
    """Bytes read from disk per decode token: the engine's own figure (Clutor's io.bytes_per_token)
    when asked and present, else the OS counter (/proc/self/io) over the decode steps."""
    if not result:
        return None
    if prefer_engine and _io(result).get("bytes_per_token") is not None:
        return float(_io(result)["bytes_per_token"])
    phases = result.get("storage_read_bytes_by_phase")
    steps = result["stats"].get("generated_tokens", 0) - 1
    if not phases or steps <= 0:
        return None
    return phases["decode"] / steps


def disk_limit_tps(read_per_token: float | None, disk_bps: float | None) -> float | None:
    """Decode tok/s if every token's reads came at the measured disk bandwidth and nothing else cost time."""
    if not read_per_token or not disk_bps or read_per_token < 4096:  # (almost) nothing read: no disk bound
        return None
    return disk_bps / read_per_token


def _peak(outcome: dict) -> int | None:
    """Peak memory of a run: the cgroup's charge when capped (includes page cache), else the process's RSS."""
    if outcome.get("cgroup_peak"):
        return outcome["cgroup_peak"]
    r = outcome.get("result")
    return None if r is None else r.get("peak_rss")


def _wait_share(result: dict) -> float | None:
    wait = _io(result).get("wait_seconds")
    s = result["stats"]
    total = (s.get("prefill_seconds") or 0) + (s.get("decode_seconds") or 0)
    return None if wait is None or total <= 0 else wait / total


# ---- sections --------------------------------------------------------------------------------

SWEEP_HEADERS = ("budget", "cache", "prefetch", "policy", "prefill tok/s", "decode tok/s", "runs", "hit rate",
                 "hit or in flight", "read/token", "wait", "peak RSS", "disk limit", "of limit")
SWEEP_BOUND_HEADERS = ("budget", "cache", "prefetch", "policy", "prefill tok/s", "decode tok/s", "runs", "in RAM", "disk bound",
                       "bound", "of bound", "own bound", "of own", "MiB/token", "Belady", "hit rate", "sim", "pf acc",
                       "pf waste", "peak RSS")

SWEEP_LEGEND = """\
budget/cache: expert-cache budget asked for, and the bytes the cache really held
prefill/decode tok/s: prompt tokens per second of the batched prefill; generated tokens per second after the
  first (which comes from the prefill's logits); with --repeat, the row's median run
runs: how many runs the row is the median of, and the lowest-highest decode tok/s among them
hit rate: routed-expert lookups served from the cache; hit or in flight: those plus the lookups whose
  prefetch read was already under way (the difference is what prefetching saved from a full wait)
read/token: expert bytes read from disk per token (Clutor's own count; OS counter when it reports none)
wait: share of prefill+decode time spent waiting for expert reads
peak RSS: the worker's peak resident set (ru_maxrss), including file pages it mapped and touched
disk limit: decode tok/s if each token's reads ran at the fio bandwidth with zero compute; of limit: decode / limit"""


def _sweep_head(run: dict) -> list:
    """A sweep row's first cells: the configuration it ran."""
    return [run["budget"], _bytes(_io(run.get("result")).get("cache_bytes") or run.get("cache_bytes")),
            _onoff(run["prefetch"]), run["policy"]]


def render_sweep(sweep: Sequence[dict], disk_bps: float | None) -> str:
    if any(run.get("bounds") for run in sweep):
        return _render_sweep_bounds(sweep)
    rows = []
    for run in sweep:
        head = _sweep_head(run)
        r = run.get("result")
        if not run.get("ok") or r is None:
            rows.append(head + [f"error: {run.get('error')}"])
            continue
        s, io = r["stats"], _io(r)
        per_tok = decode_read_per_token(r)
        limit = disk_limit_tps(per_tok, disk_bps)
        rows.append(head + [
            _rate(s.get("prefill_tps")), _rate(s.get("decode_tps")), _runs(run), _pct(io.get("hit_rate")),
            _pct(io.get("prefetch_accuracy")), _bytes(per_tok), _pct(_wait_share(r)), _bytes(_peak(run)),
            _rate(limit), _pct(s["decode_tps"] / limit if limit else None),
        ])
    return format_table(SWEEP_HEADERS, rows, left=4)


def _render_sweep_bounds(sweep: Sequence[dict]) -> str:
    rows = []
    for run in sweep:
        head = _sweep_head(run)
        r = run.get("result")
        if not run.get("ok") or r is None:
            rows.append(head + [f"error: {run.get('error')}"])
            continue
        s, io, rp = r["stats"], r.get("decode_io") or {}, r.get("replay") or {}
        rows.append(head + [_rate(s.get("prefill_tps")), _rate(s.get("decode_tps")), _runs(run),
                            *_bound_cells(run.get("bounds")),
                            _mib(io.get("bytes_per_token")), _mib(rp.get("belady_bytes_per_token")),
                            _pct(io.get("hit_rate")), _pct(rp.get("policy_hit_rate")), _pct(io.get("prefetch_accuracy")),
                            _mib(io.get("prefetch_wasted_bytes_per_token"), 2), _bytes(_peak(run))])
    return format_table(SWEEP_BOUND_HEADERS, rows, left=4) + "\n\n" + BOUNDS_LEGEND.replace(
        "tokens all streams generated per second while every stream was decoding (aggregate); vs 1: over 1 stream's",
        "decode tok/s")


PROMPT_HEADERS = ("budget", "cache", "prefetch", "policy", "TTFT s", "in RAM s", "disk s", "bound s", "of bound",
                  "read", "distinct", "read/distinct", "windows")

PROMPT_LEGEND = """\
TTFT s: time to first token (the prompt's prefill); in RAM s: the same prompt with every expert in memory, same
  run (the compute bound); disk s: the distinct experts the prompt routed to, read once, at fio's bandwidth
  around the row (the disk bound); bound s: the larger; of bound: bound / TTFT (1.00 at the bound)
read: expert bytes the prefill read from storage (/proc/self/io); distinct: those experts' bytes; windows:
  the prefill steps the prompt took (--prefill-window)"""


def render_prompt_bounds(sweep: Sequence[dict]) -> str | None:
    """Each streamed row's time to first token against its bound (rows with prefill_bounds)."""
    rows = []
    for run in sweep:
        b = run.get("prefill_bounds")
        if not b:
            continue
        s = (run.get("result") or {}).get("stats") or {}
        sec = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        rows.append(_sweep_head(run) + [sec(b["achieved"]), sec(b["compute"]), sec(b["disk"]), sec(b["bound"]),
                                        _ratio(b["bound"], b["achieved"]), _bytes(b["read_bytes"]),
                                        _bytes(b["distinct_bytes"]), _ratio(b["read_bytes"], b["distinct_bytes"]),
                                        str(s.get("prompt_windows", "-"))])
    return format_table(PROMPT_HEADERS, rows, left=4) + "\n\n" + PROMPT_LEGEND if rows else None


DURING_HEADERS = ("budget", "streams", "solo p50", "solo p99", "during p50", "during p99", "target p99", "within",
                  "gaps", "prompt", "first token", "window", "slice")

DURING_LEGEND = """\
solo: the streams decoding alone; during: their gaps between tokens wholly inside the prompt's prefill (from
  its arrival to its first token); target p99: twice the solo p99 plus one slice (--prefill-slice-ms); within:
  during p99 <= target; gaps: how many gaps the during figures are of; window: tokens of the prompt one prefill
  step took (0: chunks)"""


def render_during(report: dict) -> str:
    """``clutor bench --during-prefill N``: other streams' latency while a long prompt prefills."""
    import numpy as np

    m = report["model"]
    rows = []
    for run in report["during"]:
        res = run.get("result") or {}
        if not run.get("ok"):
            rows.append([run["budget"], "failed: " + str(run.get("error", "?"))[:70]] + ["-"] * 11)
            continue
        solo, during = np.array(res["gaps_solo"]) * 1000, np.array(res["gaps_during"]) * 1000
        ms = lambda a, q: f"{np.percentile(a, q):.0f} ms" if len(a) else "-"  # noqa: E731
        slice_ms = res["prefill_slice_ms"]
        target = 2 * np.percentile(solo, 99) + slice_ms if len(solo) else None
        within = "-" if target is None or not len(during) else ("yes" if np.percentile(during, 99) <= target else "no")
        rows.append([run["budget"], str(res["during"]), ms(solo, 50), ms(solo, 99), ms(during, 50), ms(during, 99),
                     "-" if target is None else f"{target:.0f} ms", within, str(len(during)), str(res["prompt_tokens"]),
                     f"{res['ttft']:.1f} s", str(res["prefill_window"]), f"{slice_ms:g} ms"])
    head = f"clutor bench --during-prefill: {m['path']} ({m['arch']}), {report['settings']['threads']} threads"
    return head + "\n\n" + format_table(DURING_HEADERS, rows, left=1) + "\n\n" + DURING_LEGEND


RESTART_HEADERS = ("run", "time to first token", "of cold", "prompt tokens", "from disk", "KV read", "disk bound",
                   "pages written", "pages ignored")

RESTART_LEGEND = """\
cold: a process with an empty store (it writes every full KV page as it is computed); warm: a new process, as
  after a restart, with the same prompt; from disk: prompt tokens whose KV was loaded instead of computed;
  KV read: the pages loaded (bytes); disk bound: those bytes at fio's O_DIRECT bandwidth"""


def render_restart(restart: dict, bps: float | None) -> str:
    """The cold and warm runs of ``clutor bench --prefix-cache-disk``."""
    rows = []
    cold_s = None
    for phase in ("cold", "warm"):
        run = restart.get(phase) or {}
        res = run.get("result") or {}
        st, dc = res.get("stats") or {}, res.get("disk_cache") or {}
        if not run.get("ok"):
            rows.append([phase, "failed: " + str(run.get("error", "?"))[:60]] + ["-"] * 7)
            continue
        ttft = st["prefill_seconds"]
        cold_s = ttft if phase == "cold" else cold_s
        record = dc["bytes"] / dc["files"] if dc.get("files") else 0
        loaded = dc.get("loaded", 0) * record
        rows.append([phase, f"{ttft:.2f} s", "-" if phase == "cold" or not cold_s else f"{ttft / cold_s:.3f}",
                     str(st.get("prompt_tokens", "-")), str(st.get("disk_tokens", 0)), _bytes(loaded) if loaded else "-",
                     f"{loaded / bps:.2f} s" if bps and loaded else "-", str(dc.get("written", "-")),
                     str(dc.get("rejected", "-"))])
    return format_table(RESTART_HEADERS, rows, left=1) + "\n\n" + RESTART_LEGEND


COMPARE_HEADERS = ("setting", "memory cap", "engine", "configuration", "prefill tok/s", "decode tok/s",
                   "peak memory", "read/token", "of disk limit")

PROFILE_LEGEND = """\
profile: wall time per step (decode: one token per sequence; prefill: the prompt), per span; kernels: the
  span's matrix products (quantised weights x activations), glue: the rest of the span (norms, RoPE, softmax,
  attention over the KV cache, gathers); wait for reads: the model coroutine waiting on expert bytes;
  hand-off and Python: what no span covers (trips to the compute thread, the event loop, Python code)"""


COMPARE_LEGEND = """\
ratio: Clutor's tok/s divided by llama.cpp's (above 1.00x: Clutor is faster)
peak memory: peak RSS uncapped; in capped rows the cgroup's peak charge (process memory + page cache it pulled in)
read/token: bytes read from storage per decode token by the OS counter (/proc/self/io), the same for both engines
of disk limit: decode tok/s over (disk bandwidth / read per token)"""


def render_comparison(comparison: dict, disk_bps: float | None, tokens: int) -> str:
    rows = []
    for row in comparison["rows"]:
        setting = row["setting"]
        cap = "none" if row.get("cap") is None else format_bytes(row["cap"])
        figures = {}
        for engine, key, config in (("Clutor", "clutor", row.get("clutor_config", "")),
                                    ("llama.cpp", "llama", row.get("llama_config", ""))):
            out = row.get(key)
            first = [setting, cap, engine, config]
            setting = cap = ""
            if out is None:
                rows.append(first + ["not run"])
                continue
            r = out.get("result")
            if not out.get("ok") or r is None:
                rows.append(first + [f"error: {out.get('error')}"])
                continue
            s = r["stats"]
            per_tok = decode_read_per_token(r, prefer_engine=False)
            limit = disk_limit_tps(per_tok, disk_bps)
            figures[key] = r
            rows.append(first + [_rate(s.get("prefill_tps")), _rate(s.get("decode_tps")), _bytes(_peak(out)),
                                 _bytes(per_tok), _pct(s["decode_tps"] / limit if limit else None)])
        if "clutor" in figures and "llama" in figures:
            c, l = figures["clutor"]["stats"], figures["llama"]["stats"]
            rows.append(["", "", "ratio", "Clutor / llama.cpp", _ratio(c.get("prefill_tps"), l.get("prefill_tps")),
                         _ratio(c.get("decode_tps"), l.get("decode_tps")), "", "", ""])
    text = format_table(COMPARE_HEADERS, rows, left=4)
    notes = list(comparison.get("notes", []))
    for row in comparison["rows"]:
        c = (row.get("clutor") or {}).get("result")
        l = (row.get("llama") or {}).get("result")
        if c and l:
            same = _common_prefix(c.get("tokens", []), l.get("tokens", []))
            prompt = "same prompt ids" if c.get("prompt_digest") == l.get("prompt_digest") else "DIFFERENT prompt ids"
            if l.get("forced"):  # llama.cpp decoded Clutor's ids: equal by construction; its own argmax says how close
                notes.append(f"{row['setting']}: {prompt}; llama.cpp decoded Clutor's {len(l.get('tokens', []))} ids "
                             f"(forced), its own argmax agreeing on {l.get('forced_argmax_agree')}")
            else:
                notes.append(f"{row['setting']}: {prompt}; greedy tokens agree for the first {same} of {tokens}")
    return "\n".join([text, "", *notes, "", COMPARE_LEGEND]) if notes else "\n".join([text, "", COMPARE_LEGEND])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _decode_runs(row: dict) -> list[float]:
    return row.get("decode_runs") or [row["result"]["stats"]["decode_tps"]]


def _runs(row: dict) -> str:
    runs = _decode_runs(row)
    failed = row.get("failed_runs") or 0
    text = str(len(runs)) if len(runs) < 2 else f"{len(runs)}: {_rate(min(runs))}-{_rate(max(runs))}"
    return text + (f" ({failed} failed)" if failed else "")


def _summary(sweep: Sequence[dict], disk_bps: float | None) -> str | None:
    """One sentence on the row with the highest (median) decode: against the disk-bound limit, and whether
    it is really the fastest: only when every one of its runs beat every run of every other row."""
    ok = [r for r in sweep if r.get("ok") and r.get("result")]
    if not ok:
        return "no run succeeded"
    best = max(ok, key=lambda r: r["result"]["stats"]["decode_tps"])
    tps = best["result"]["stats"]["decode_tps"]

    def label(r: dict) -> str:
        return f"budget {r['budget']}, prefetch {_onoff(r['prefetch'])}, policy {r['policy']}"

    text = f"{label(best)}: {_rate(tps)} tok/s decode"
    per_tok = decode_read_per_token(best["result"])
    limit = disk_limit_tps(per_tok, disk_bps)
    if limit:
        text += (f", {100 * tps / limit:.0f}% of the disk-bound limit ({_rate(limit)} tok/s = "
                 f"{format_bytes(disk_bps)}/s / {format_bytes(per_tok)} per token)")
    others = [r for r in ok if r is not best]
    if not others:
        return text
    n = min(len(_decode_runs(r)) for r in ok)
    if n < 2:
        return (f"highest decode: {text}. One run per row names no fastest: runs of one configuration here "
                f"differ by 10% and more (--repeat 3 to find out)")
    close = [r for r in others if max(_decode_runs(r)) >= min(_decode_runs(best))]
    if not close:
        return f"fastest, every one of its {n}+ runs above every run of the other rows: {text}"
    return (f"no clear fastest: the runs of {label(best)} overlap those of " + "; ".join(label(r) for r in close)
            + f". Highest median: {text}")


def render_report(report: dict) -> str:
    m, st, disk = report["model"], report["settings"], report["disk"]
    head = [
        f"clutor bench: {m['path']}",
        f"model: {m['arch']}, {format_bytes(m['file_bytes'])} file; dense {format_bytes(m['dense_bytes'])} "
        f"(resident), experts {format_bytes(m['expert_bytes_total'])}",
        f"run: {st['prompt_tokens']}-token prompt, {st['tokens']} greedy tokens (EOS ignored), io {st['io']}"
        f"{'' if st.get('direct', True) else ' buffered'}, {st['threads']} threads; one fresh process per row, "
        f"after a warm-up (a prompt of up to {WARMUP_PROMPT_TOKENS} tokens)",
        f"disk: {disk['note']}",
    ]
    parts = ["\n".join(head), "", render_sweep(report["sweep"], disk.get("bytes_per_second"))]
    prompt = render_prompt_bounds(report["sweep"])
    parts += ["", prompt] if prompt else []
    summary = _summary(report["sweep"], disk.get("bytes_per_second"))
    parts += ["", summary] if summary else []
    parts += ["", SWEEP_LEGEND]
    for row in report["sweep"]:
        prof = (row.get("result") or {}).get("profile")
        if prof:
            parts += ["", f"profile: budget {row['budget']}, prefetch {_onoff(row['prefetch'])}, policy {row['policy']}"]
            parts += [render_profile(phase, p) for phase, p in sorted(from_json(prof).items())]
            parts += [PROFILE_LEGEND]
    if report.get("restart"):
        parts += ["", "", "Prefix cache on disk, across a restart", "",
                  render_restart(report["restart"], disk.get("bytes_per_second"))]
    if report.get("comparison"):
        parts += ["", "", "Clutor vs llama.cpp", "",
                  render_comparison(report["comparison"], disk.get("bytes_per_second"), st["tokens"])]
    return "\n".join(parts)


# ---- concurrency -----------------------------------------------------------------------------

CONCURRENCY_HEADERS = ("streams", "tok/s", "vs 1", "in RAM", "disk bound", "bound", "of bound", "own bound", "of own",
                       "MiB/token", "Belady", "hit rate", "sim", "pf acc", "pf waste", "lag p99", "loop/tok", "peak")

BOUNDS_LEGEND = """\
tok/s: tokens all streams generated per second while every stream was decoding (aggregate); vs 1: over 1 stream's
in RAM: the same workload with every expert in memory, same run (the compute bound)
disk bound: fio's O_DIRECT bandwidth around the row (the fastest of slab-sized reads 32 and 128 deep, before
  and after) over Belady's bytes per token (the fewest a cache of
  this size must read for the row's own routing: its trace replayed); bound: min(in RAM, disk bound); of bound:
  tok/s / bound; own bound: min(in RAM, fio / the row's own bytes per token); of own: tok/s / own bound
MiB/token: expert bytes the row read per generated token (demand + prefetch); Belady: Belady's, same window
hit rate: the store's (distinct experts a step asked for, found in the cache); sim: the row's policy replayed
  on its own trace by the simulator, same window (a live cache should reach it)
pf acc: prefetched experts that served a demand; pf waste: MiB per token prefetched and never used
lag p99: event-loop lag of a 5 ms ticker beside the streams; loop/tok: the event-loop thread's CPU time per token
  (expert I/O submission and completion, scheduling, the readers); peak: the cgroup's peak charge (capped) or RSS"""


def _mib(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x / 2**20:.{digits}f}"


def _bound_cells(b: dict | None) -> list[str]:
    """in RAM, disk bound, bound, of bound, own bound, of own."""
    if not b:
        return ["-"] * 6

    def rate(x):
        return "inf" if x == "inf" else _rate(x)

    return [rate(b.get("compute")), rate(b.get("disk")), rate(b.get("bound")), _pct(b.get("of_bound")),
            rate(b.get("own_bound")), _pct(b.get("of_own_bound"))]


def render_concurrency(report: dict) -> str:
    """The --concurrency tables, one per (budget, prefetch, policy): steady-state decode with N streams in
    one batch, each row against its bounds (clutor.bench.bounds), then llama.cpp's one stream in the same
    cap and in RAM (with the first table)."""
    return "\n\n".join([*(_render_concurrency_table(report, c) for c in report["concurrency"]), BOUNDS_LEGEND])


def _render_concurrency_table(report: dict, c: dict) -> str:
    bps = c["disk_bytes_per_second"]
    one = next((r["result"]["aggregate_decode_tps"] for r in c["rows"] if r["ok"] and r["streams"] == 1), None)
    rows = []
    for row in c["rows"]:
        if not row["ok"]:
            rows.append([str(row["streams"]), f"FAILED: {row['error']}"])
            continue
        r = row["result"]
        io = r.get("decode_io") or {}
        rp = r.get("replay") or {}
        peak = row.get("cgroup_peak") or r.get("peak_rss")
        rows.append([str(row["streams"]), _rate(r["aggregate_decode_tps"]), _ratio(r["aggregate_decode_tps"], one),
                     *_bound_cells(row.get("bounds")),
                     _mib(io.get("bytes_per_token", r.get("bytes_per_token"))), _mib(rp.get("belady_bytes_per_token")),
                     _pct(io.get("hit_rate", r.get("hit_rate"))), _pct(rp.get("policy_hit_rate")),
                     _pct(io.get("prefetch_accuracy")), _mib(io.get("prefetch_wasted_bytes_per_token"), 2),
                     f"{1e3 * r['loop_lag_p99']:.1f} ms",
                     "-" if r.get("loop_cpu_per_token") is None else f"{1e3 * r['loop_cpu_per_token']:.2f} ms",
                     _bytes(peak)])
    cap = c["cap"]
    head = (f"{report['model']['path']}: expert cache {c['budget']}, prefetch {_onoff(c['prefetch'])}, policy "
            f"{c['policy']}, workload {c.get('workload', 'ids')}, " +
            (f"whole process capped at {format_bytes(cap)}" if cap else "uncapped") +
            (f"; disk {bps / 2**30:.2f} GiB/s (fio, at the start)" if bps else f"; {report.get('disk', {}).get('note', 'disk not measured')}"))
    parts = [head, "", format_table(CONCURRENCY_HEADERS, rows)]
    fio = [f"{row['streams']}: " + " / ".join(f"{x / 2**30:.2f}" for x in row["disk"]["samples"] if x) for row in c["rows"]
           if (row.get("disk") or {}).get("samples")]
    if fio:
        huge = all((row.get("disk") or {}).get("huge_pages") for row in c["rows"] if row.get("disk"))
        pages = ("its buffers in huge pages, as Clutor's" if huge else
                 "its buffers in 4 KiB pages (the disk note says why), Clutor's in huge pages, which a disk may "
                 "serve faster")
        parts += ["", "fio around each row, GiB/s (before: slab x 32, slab x 128; after: the same; the disk bound takes "
                      f"the fastest; {pages}): " + ", ".join(fio)]
    spread = [_rounds_line(row) for row in c["rows"] if len(row.get("rounds") or ()) > 1]
    if spread:
        parts += ["", "rounds (--repeat; each streamed run beside its own in-RAM bound; the row above is the median "
                      "round): tok/s, of bound, of own", *spread]
    if c.get("llama"):
        parts += ["", _render_llama(c["llama"], c["rows"])]
    return "\n".join(parts)


def _rounds_line(row: dict) -> str:
    def cells(key: str, fmt) -> str:
        vals = [r[key] for r in row["rounds"]]
        return " / ".join("-" if v is None else fmt(v) for v in vals)

    return (f"  {row['streams']}: {cells('tps', _rate)}; of bound {cells('of_bound', _pct)}; "
            f"of own {cells('of_own', _pct)}")


def _render_llama(llama: list[dict], rows: list[dict]) -> str:
    one = next((r["result"] for r in rows if r["ok"] and r["streams"] == 1), None)
    out = []
    for l in llama:
        if not l.get("ok"):
            out.append(["llama.cpp", l["setting"], f"error: {l.get('error')}"])
            continue
        s = l["result"]["stats"]
        per_tok = decode_read_per_token(l["result"], prefer_engine=False)
        peak = l.get("cgroup_peak") or l["result"].get("peak_rss")
        forced = l["result"].get("forced")
        out.append(["llama.cpp", l["setting"] + (", forced" if forced else ""), _rate(s["decode_tps"]), _mib(per_tok),
                    _ratio(one["aggregate_decode_tps"], s["decode_tps"]) if one else "-", _bytes(peak)])
    return format_table(("engine", "1 stream", "decode tok/s", "MiB/token read (OS)", "Clutor 1 stream / this", "peak"),
                        out, left=2) + (
        "\nforced: llama.cpp decoded the ids Clutor's 1-stream row generated (the same forward passes and routing); "
        "its own argmax agreed on " + ", ".join(f"{l['result']['forced_argmax_agree']}/{l['result']['stats']['generated_tokens']}"
                                                for l in llama if l.get("ok") and l["result"].get("forced"))
        if any(l.get("ok") and l["result"].get("forced") for l in llama) else "")

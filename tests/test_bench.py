"""clutor bench: the worker processes (smoke: valid JSON, positive speeds), the prompt, budget and
argument parsing, the report tables on a fake result set. No timing assertions."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from clutor.bench import report as rep
from clutor.model import kernels
from clutor.io.policies import DEFAULT_POLICY
from clutor.bench.prompt import bench_prompt, prompt_digest
from clutor.bench.runner import Budget, estimate_footprint, kv_bytes, parse_budget, parse_budgets, run_worker
from clutor.bench.worker import _open_kwargs, to_jsonable
from clutor.cli import bench as bench_cli
from clutor.errors import ClutorError
from conftest import fixture_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The committed tiny OLMoE fixture, or one written by tools/synth.py when it is absent."""
    path = fixture_path("olmoe", "Q8_0")
    if path.exists():
        return str(path)
    try:
        from synth import write_model
    except ImportError:
        pytest.skip(f"no {path.name} fixture and no tools/synth.py to make one")
    return str(write_model(tmp_path_factory.mktemp("bench") / path.name, "tiny-olmoe", seed=0, qtype="Q8_0"))


def _worker(module: str, model: str, args: dict) -> tuple[int, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", module, model, "--json-args", json.dumps(args)],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one JSON line, got stdout={p.stdout!r} stderr={p.stderr[-2000:]!r}"
    return p.returncode, json.loads(lines[0])


def test_concurrency_worker_reports_the_steady_state_of_n_streams(tiny):
    rc, d = _worker("clutor.bench.worker", tiny, {"io": "threads", "expert_cache": "50%", "prompt_tokens": 8,
                                                   "tokens": 6, "concurrency": 3})
    assert rc == 0, d
    assert d["concurrency"] == 3
    w = d["window"]
    # the window runs from the last stream's first token to the first stream's end: 3 streams x 5 tokens
    assert w["tokens"] == 3 * 5 and w["steps"] == 5 and w["seconds"] > 0
    assert d["aggregate_decode_tps"] == pytest.approx(w["tokens"] / w["seconds"])
    assert d["stream_decode_tps"] == pytest.approx(d["aggregate_decode_tps"] / 3)
    assert 0 <= d["hit_rate"] <= 1 and d["bytes_per_step"] >= 0 and d["loop_lag_p99"] >= 0


def test_bench_concurrency_table(tiny, capsys):
    args = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [tiny, "--concurrency", "1,2", "--budgets", "50%", "--prefetch", "off", "--io", "threads",
         "--tokens", "4", "--prompt-tokens", "8", "--fio-seconds", "0"])
    assert bench_cli.run(args) == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l[:1].isdigit()]
    assert [l.split()[0] for l in lines] == ["1", "2"], out
    assert "1.00x" in lines[0] and "in RAM" in out and "Belady" in out
    # each row has its in-RAM twin's tok/s (the compute bound) and Belady's bytes from its own trace
    for line in lines:
        cells = line.split()
        assert float(cells[3]) > 0 and cells[10] != "-", line


def test_bench_concurrency_runs_every_budget(tiny, capsys, monkeypatch):
    """--concurrency with two budgets: a table for each, in order, each row run at its own budget, and
    the in-RAM bound (which no budget changes) run once per stream count and shared by both tables."""
    real, calls = bench_cli._compute_run, []

    def counted(args, common, streams, progress):
        calls.append(streams)
        return real(args, common, streams, progress)

    monkeypatch.setattr(bench_cli, "_compute_run", counted)
    args = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [tiny, "--concurrency", "1", "--budgets", "25%,100%", "--prefetch", "off", "--io", "threads",
         "--tokens", "4", "--prompt-tokens", "8", "--fio-seconds", "0", "--json"])
    assert bench_cli.run(args) == 0
    tables = json.loads(capsys.readouterr().out)["concurrency"]
    assert [t["budget"] for t in tables] == ["25%", "100%"]
    assert [t["rows"][0]["result"]["options"]["expert_cache"] for t in tables] == ["25%", "100%"]
    assert calls == [1]
    assert tables[0]["rows"][0]["compute"] == tables[1]["rows"][0]["compute"] is not None
    assert all(t["rows"][0]["bounds"]["compute"] > 0 for t in tables)


# ---- workers ---------------------------------------------------------------------------------

def test_worker_prints_one_json_line_with_positive_speeds(tiny):
    rc, d = _worker("clutor.bench.worker", tiny, {"io": "memory", "prompt_tokens": 8, "tokens": 4})
    assert rc == 0, d
    s = d["stats"]
    assert s["prompt_tokens"] == 8 and s["generated_tokens"] == 4 and len(d["tokens"]) == 4
    assert s["prefill_tps"] > 0 and s["decode_tps"] > 0
    assert s["prefill_seconds"] > 0 and s["decode_seconds"] > 0
    assert d["peak_rss"] > 0 and d["memory"]["ru_maxrss"] > 0
    assert d["options"]["io"] == "memory" and d["n_ctx"] == 8 + 4 + 8
    assert d["seconds"]["generate"] >= s["prefill_seconds"] + s["decode_seconds"] * 0.99


def test_the_warm_up_prepares_every_kernel_the_measured_decode_runs(tiny, monkeypatch):
    """A kernel first called inside the measured window compiles there on a checkout's first run (or
    loads from the cache), and the run's tok/s then measures that: the warm-up runs a decode step, so the
    measured generation calls no kernel specialisation the warm-up did not."""
    from clutor.bench import worker

    seen, real = [], worker._generate

    async def spy(model, ids, max_tokens, sampling=None):
        out = await real(model, ids, max_tokens, sampling)
        seen.append(kernels.loaded())
        return out

    monkeypatch.setattr(worker, "_generate", spy)
    worker.run(tiny, {"io": "memory", "prompt_tokens": 8, "tokens": 4})
    warm, measured = seen
    assert measured <= warm, f"first called in the measured window: {sorted(measured - warm)}"


def test_bench_profile_splits_decode_steps_into_spans(tiny, capsys):
    """--profile: each decode step's wall time is split into spans that add up to no more than the step,
    the spans that run matrix products report kernel time, and the report prints the table."""
    args = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [tiny, "--budgets", "50%", "--prefetch", "off", "--io", "threads", "--tokens", "5", "--prompt-tokens", "8",
         "--fio-seconds", "0", "--profile"])
    assert bench_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "decode: 4 steps, 4 tokens" in out and "prefill: 1 steps, 8 tokens" in out, out
    rc, d = _worker("clutor.bench.worker", tiny, {"io": "threads", "expert_cache": "50%", "prompt_tokens": 8,
                                                   "tokens": 5, "profile": True})
    assert rc == 0, d
    dec = d["profile"]["decode"]
    assert dec["steps"] == 4 and dec["tokens"] == 4  # the first token comes from the prefill
    spans = dec["spans"]
    for name in ("attention", "router", "experts", "output", "sampling", "wait for reads"):
        assert spans[name]["seconds"] > 0 and spans[name]["calls"] >= 4, (name, spans)
    for name in ("attention", "experts", "output"):  # their matrix products are timed inside them
        assert 0 < spans[name]["kernel_seconds"] <= spans[name]["seconds"], (name, spans[name])
    # spans on the compute thread and the coroutine's waits never overlap: they fit in the steps' time
    assert sum(s["seconds"] for s in spans.values()) <= dec["seconds"]


def test_worker_reports_bad_input_as_json_error(tmp_path):
    rc, d = _worker("clutor.bench.worker", str(tmp_path / "missing.gguf"), {"io": "memory"})
    assert rc == 1 and "missing.gguf" in d["error"]
    rc, d = _worker("clutor.bench.worker", str(tmp_path / "missing.gguf"), {"budget": "25%"})
    assert rc == 1 and "unknown benchmark option" in d["error"] and "budget" in d["error"]


def test_run_worker_turns_failures_into_outcomes(tmp_path):
    o = run_worker(str(tmp_path / "nope.gguf"), "clutor", {"io": "memory"}, timeout=120)
    assert not o.ok and o.result is None and "nope.gguf" in o.error and "\n" not in o.error


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_worker_same_prompt_positive_speeds(tiny):
    args = {"prompt_tokens": 8, "tokens": 4}
    rc, d = _worker("clutor.bench.llama_worker", tiny, args)
    assert rc == 0, d
    assert d["engine"] == "llama.cpp" and d["stats"]["generated_tokens"] == 4 and len(d["tokens"]) == 4
    assert d["stats"]["prefill_tps"] > 0 and d["stats"]["decode_tps"] > 0
    from clutor.model.tokenizer import Tokenizer

    assert d["prompt_digest"] == prompt_digest(bench_prompt(Tokenizer.from_gguf(tiny), 8, 0))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_worker_forced_decodes_clutors_tokens(tiny):
    """--vs-llama-cpp's row decodes the ids Clutor's sampled stream generated: llama.cpp's tokens are
    those ids (not its own draws), and on equal logits its argmax agrees where Clutor's pick was the argmax."""
    args = {"prompt_tokens": 8, "tokens": 6, "workload": "text", "seed": 3}
    rc, c = _worker("clutor.bench.worker", tiny, {**args, "io": "memory", "concurrency": 1})
    assert rc == 0, c
    forced = c["tokens"]
    assert len(forced) == 6
    rc, own = _worker("clutor.bench.llama_worker", tiny, args)
    rc2, d = _worker("clutor.bench.llama_worker", tiny, {**args, "forced": forced,
                                                         "forced_prompt_digest": c["prompt_digests"][0]})
    assert rc == rc2 == 0, d
    assert d["tokens"] == forced and d["forced"] and own["forced"] is False
    assert d["stats"]["generated_tokens"] == 6 and 0 <= d["forced_argmax_agree"] <= 6


@pytest.mark.parametrize("forced, digest, why", [
    ([1, 2], None, "expected a list of 3 token ids"),
    ([1, 2, 10**9], None, "not in the vocabulary"),
    ([1, 2, 3], "0" * 16, "followed another prompt"),
])
def test_llama_worker_refuses_bad_forced_ids(tiny, forced, digest, why):
    """Bad forced ids are one clear error naming the option, before llama.cpp is even imported."""
    rc, d = _worker("clutor.bench.llama_worker", tiny, {"prompt_tokens": 8, "tokens": 3, "forced": forced,
                                                        "forced_prompt_digest": digest})
    assert rc != 0 and "forced" in d["error"] and why in d["error"], d


def test_bench_forces_llama_cpp_onto_clutors_tokens():
    """llama.cpp's rows get the ids and prompt of the Clutor run they are compared with: the concurrency
    table's 1-stream row, a single run's result (text workload only)."""
    from types import SimpleNamespace

    from clutor.cli.bench import _forced, _one_stream

    rows = [{"streams": 4, "ok": True, "result": {"tokens": [9, 9, 9], "prompt_digests": ["b"] * 4}},
            {"streams": 1, "ok": True, "result": {"tokens": [5, 6, 7], "prompt_digests": ["a"]}}]
    text = SimpleNamespace(workload="text", tokens=3)
    assert _forced(text, _one_stream(rows)) == {"forced": [5, 6, 7], "forced_prompt_digest": "a"}
    assert _forced(text, {"tokens": [1, 2, 3], "prompt_digest": "c"}) == {"forced": [1, 2, 3],
                                                                           "forced_prompt_digest": "c"}
    assert _forced(SimpleNamespace(workload="ids", tokens=3), _one_stream(rows)) == {}
    assert _forced(text, _one_stream(rows[:1])) == {}  # no 1-stream row: llama.cpp chooses its own
    assert _forced(text, _one_stream([{**rows[1], "ok": False}])) == {}
    assert _forced(text, {"tokens": [1, 2], "prompt_digest": "c"}) == {}  # stopped short: not the same work


# ---- prompt ----------------------------------------------------------------------------------

def test_bench_prompt_is_deterministic_and_avoids_stop_tokens(tiny):
    from clutor.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(tiny)
    a, b = bench_prompt(tok, 600, seed=3), bench_prompt(tok, 600, seed=3)
    assert a == b and len(a) == 600 and prompt_digest(a) == prompt_digest(b)
    assert bench_prompt(tok, 600, seed=4) != a
    body = a[1:] if tok.add_bos and tok.bos_id is not None else a
    assert not set(body) & set(tok.stop_ids)
    assert all(tok.token_bytes(i) for i in body)
    assert all(0 <= i < tok.n_vocab for i in a)
    with pytest.raises(ClutorError):
        bench_prompt(tok, 0)


# ---- option handling -------------------------------------------------------------------------

def test_parse_budget():
    assert parse_budget("25%") == Budget("25%", fraction=0.25)
    assert parse_budget("25%").worker_value == "25%"
    assert parse_budget("256MiB").nbytes == 256 << 20 and parse_budget("256MiB").worker_value == 256 << 20
    assert parse_budget("3GiB").nbytes == 3 << 30
    assert parse_budget("auto").worker_value is None
    for bad in ("lots", "0%", "150%", "-5%", "0", "1.5.5GiB", "%"):
        with pytest.raises(ValueError):
            parse_budget(bad)
    assert [b.text for b in parse_budgets("10%, 25%,25%,1GiB")] == ["10%", "25%", "1GiB"]
    with pytest.raises(ValueError):
        parse_budgets(" , ")


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clutor")
    bench_cli.add_parser(p.add_subparsers(dest="command"))
    return p


def test_cli_arguments_and_bad_input(capsys, tmp_path):
    a = _bench_parser().parse_args(["bench", "m.gguf"])
    assert [b.text for b in a.budgets] == ["10%", "25%", "50%", "100%"]
    assert a.prefetch == [True, False] and a.policy == [DEFAULT_POLICY] and a.cap == "auto"
    a = _bench_parser().parse_args(["bench", "m.gguf", "--budgets", "256MiB,25%", "--prefetch", "off",
                                    "--policy", "lru,lfu", "--cap", "3GiB", "--allowance", "1GiB"])
    assert [b.worker_value for b in a.budgets] == [256 << 20, "25%"]
    assert a.prefetch == [False] and a.policy == ["lru", "lfu"] and a.cap == 3 << 30 and a.allowance == 1 << 30
    for bad in (["--budgets", "lots"], ["--prefetch", "maybe"], ["--cap", "big"], ["--tokens", "0"]):
        with pytest.raises(SystemExit) as e:
            _bench_parser().parse_args(["bench", "m.gguf", *bad])
        assert e.value.code == 2
        assert "Traceback" not in capsys.readouterr().err
    args = _bench_parser().parse_args(["bench", str(tmp_path / "absent.gguf")])
    with pytest.raises(ClutorError, match="absent.gguf"):
        bench_cli.run(args)


def test_open_kwargs_refuses_knobs_the_model_lacks():
    async def old_open(path, *, n_ctx=None):
        pass

    async def new_open(path, *, n_ctx=None, expert_cache=None, prefetch=None, policy="lru", io="auto",
                       direct=True):
        pass

    opts = {"n_ctx": 32, "expert_cache": "25%", "prefetch": True, "policy": "lfu", "io": "uring", "direct": True}
    kw, ignored = _open_kwargs(new_open, opts)
    assert kw == opts and ignored == []
    with pytest.raises(ClutorError, match="expert_cache"):
        _open_kwargs(old_open, opts)
    # experts from memory ask nothing of a store, so a model without the options runs them as is
    kw, ignored = _open_kwargs(old_open, {**opts, "io": "memory"})
    assert kw == {"n_ctx": 32} and set(ignored) == {"expert_cache", "prefetch", "policy", "io", "direct"}


def test_to_jsonable_keeps_derived_properties():
    @dataclass(frozen=True)
    class IO:
        hit_rate: float

    @dataclass(frozen=True)
    class Stats:
        n: int
        seconds: float
        io: IO | None

        @property
        def tps(self) -> float:
            return self.n / self.seconds

    d = to_jsonable(Stats(4, 2.0, IO(0.5)))
    assert d == {"n": 4, "seconds": 2.0, "io": {"hit_rate": 0.5}, "tps": 2.0}
    json.dumps(d)


def test_footprint_estimate_adds_its_parts():
    desc = {"dense_bytes": 1000, "config": {"n_layers": 2, "n_head_kv": 4, "head_dim": 8, "head_dim_v": 8}}
    assert kv_bytes(desc, 10) == 2 * 4 * 10 * 16 * 4
    assert estimate_footprint(desc, 5000, 10, 300) == 1000 + 5000 + kv_bytes(desc, 10) + 300


# ---- report ----------------------------------------------------------------------------------

def _fake_result(prefill, decode, *, io=None, tokens=(1, 2, 3, 4), digest="abc", peak=300 << 20, decode_read=None):
    return {"stats": {"prompt_tokens": 8, "generated_tokens": 4, "prefill_seconds": 8 / prefill,
                      "decode_seconds": 3 / decode, "prefill_tps": prefill, "decode_tps": decode},
            "io": io, "tokens": list(tokens), "prompt_digest": digest, "peak_rss": peak,
            "storage_read_bytes_by_phase": None if decode_read is None else {"prefill": 0, "decode": decode_read}}


def _fake_report() -> dict:
    io = {"hit_rate": 0.531, "prefetch_accuracy": 0.8, "bytes_per_token": 64 << 20, "wait_seconds": 0.5,
          "cache_bytes": 1 << 30}
    ok = {"ok": True, "error": None, "cgroup_peak": None,
          "result": _fake_result(40.0, 4.0, io=io)}
    failed = {"ok": False, "error": "expert cache of 1.00 MiB is too small", "cgroup_peak": None, "result": None}
    llama = {"ok": True, "error": None, "cgroup_peak": 2 << 30,
             "result": _fake_result(20.0, 2.0, tokens=(1, 2, 9, 9), decode_read=3 * (128 << 20))}
    return {
        "model": {"path": "m.gguf", "arch": "olmoe", "file_bytes": 7 << 30, "dense_bytes": 500 << 20,
                  "expert_bytes_total": 6 << 30},
        "settings": {"prompt_tokens": 8, "tokens": 4, "io": "auto", "direct": True, "threads": 2},
        "disk": {"bytes_per_second": float(1 << 30), "note": "fio: 1.00 GiB/s"},
        "sweep": [{"budget": "25%", "cache_bytes": None, "prefetch": True, "policy": "lru", **ok},
                  {"budget": "1MiB", "cache_bytes": 1 << 20, "prefetch": False, "policy": "lfu", **failed}],
        "comparison": {"rows": [{"setting": "capped", "cap": 3 << 30, "clutor_config": "25%, prefetch on, lru",
                                 "clutor": ok, "llama_config": "mmap", "llama": llama}],
                       "notes": ["capped: cgroup memory limit 3.00 GiB"]},
    }


def test_report_renders_a_fake_result_set():
    text = rep.render_report(_fake_report())
    for header in ("budget", "prefill tok/s", "decode tok/s", "runs", "hit rate", "hit or in flight", "read/token", "wait",
                   "peak RSS", "disk limit", "of limit", "memory cap", "ratio"):
        assert header in text, header
    sweep = rep.render_sweep(_fake_report()["sweep"], float(1 << 30))
    lines = sweep.splitlines()
    assert len({len(lines[0]), len(lines[1]), len(lines[2])}) == 1  # header, rule and row aligned
    row = lines[2]
    assert "1.00 GiB" in row and "53.1%" in row and "80.0%" in row and "64.00 MiB" in row
    assert "40.0" in row and "4.00" in row and "52.6%" in row  # wait: 0.5 s of 8/40 + 3/4 s
    assert "16.0" in row and "25.0%" in row  # disk limit 1 GiB/s / 64 MiB = 16 tok/s; 4 / 16
    assert "error: expert cache of 1.00 MiB is too small" in lines[3]
    assert lines[3].startswith("1MiB")
    assert "2.00x" in text  # 40/20 prefill and 4/2 decode
    assert "budget 25%, prefetch on, policy lru: 4.00 tok/s decode, 25% of the disk-bound limit" in text
    assert "fastest" not in text  # one configuration ran: nothing to be faster than
    assert "greedy tokens agree for the first 2 of 4" in text and "same prompt ids" in text
    assert "128 MiB" in text  # llama's OS-counted decode reads per token


def test_report_puts_a_prompts_time_against_its_bound():
    """A streamed row with prefill_bounds gets a line of the prompt table: its seconds, both bounds,
    the ratio and the bytes read over the distinct experts' bytes."""
    from clutor.bench.bounds import prefill_bounds

    report = _fake_report()
    row = report["sweep"][0]
    row["result"]["stats"]["prompt_windows"] = 1
    row["prefill_bounds"] = prefill_bounds(8.0, 6.0, float(1 << 30), 2 << 30, 3 << 30)
    text = rep.render_report(report)
    line = next(l for l in text.splitlines() if l.startswith(row["budget"]) and "8.0" in l and "6.0" in l)
    assert "2.0" in line and "0.75x" in line and "3.00 GiB" in line and "2.00 GiB" in line and "1.50x" in line
    assert "TTFT s" in text and "of bound" in text


def _row(budget: str, *runs: float) -> dict:
    return {"budget": budget, "cache_bytes": None, "prefetch": False, "policy": "lrfu", "ok": True, "error": None,
            "cgroup_peak": None, "result": _fake_result(40.0, sorted(runs)[(len(runs) - 1) // 2]),
            "decode_runs": list(runs)}


def test_a_fastest_row_is_named_only_when_its_runs_beat_every_other():
    one = rep._summary([_row("25%", 4.1), _row("50%", 4.0)], None)
    assert one.startswith("highest decode: budget 25%") and "--repeat" in one and "fastest" not in one.split(".")[0]
    clear = rep._summary([_row("25%", 4.1, 4.3, 4.2), _row("50%", 3.0, 3.9, 3.5)], None)
    assert clear.startswith("fastest, every one of its 3+ runs above") and "budget 25%" in clear
    overlap = rep._summary([_row("25%", 4.1, 4.3, 4.2), _row("50%", 3.0, 4.15, 3.5), _row("10%", 1, 1.1)], None)
    assert overlap.startswith("no clear fastest: the runs of budget 25%") and "budget 50%" in overlap
    assert "budget 10%" not in overlap.split(". Highest")[0]
    assert "3: 4.10-4.30" in rep.render_sweep([_row("25%", 4.1, 4.3, 4.2)], None)


def test_format_table_lets_errors_run_on():
    t = rep.format_table(["a", "bb", "c"], [["1", "2", "3"], ["x", "error: long message here"]])
    lines = t.splitlines()
    assert lines[0] == "a  bb  c" and lines[2] == "1   2  3" and lines[3] == "x  error: long message here"


# -- bench-io: the page cache is the machine's ------------------------------------------------------
def _bench_io(path, *extra):
    from clutor.cli import main

    return main(["bench-io", str(path), "--mode", "buffered", "--io", "threads", "--no-fio", "--block", "64KiB",
                 "--depth", "1", "--seconds", "0.05", "--json", *extra])


def test_bench_io_never_drops_the_page_cache_unasked(tmp_path, monkeypatch, capsys):
    import clutor.bench.disk as disk

    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(1 << 20))
    dropped = []
    monkeypatch.setattr(disk, "drop_caches", lambda: dropped.append(1) or True)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # as root, where dropping would work
    assert _bench_io(f) == 0
    out, err = capsys.readouterr()
    assert dropped == [] and json.loads(out)["dropped_caches"] is False
    assert any("--drop-caches" in n for n in json.loads(out)["notes"])
    assert "clutor bench-io: reading" in err and "about 0 s of measuring" in err  # said before it starts
    assert _bench_io(f, "--drop-caches") == 0
    assert dropped == [1] and json.loads(capsys.readouterr().out)["dropped_caches"] is True
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _bench_io(f, "--drop-caches") == 1  # asked without root: refused before anything runs
    err = capsys.readouterr().err
    assert err.startswith("clutor: error: --drop-caches needs root") and err.count("\n") == 1


def test_bench_io_states_the_test_file_and_duration_first(tmp_path, capsys):
    from clutor.cli import main

    assert main(["bench-io", "--dir", str(tmp_path), "--size", "1MiB", "--mode", "buffered", "--io", "threads",
                 "--no-fio", "--block", "64KiB,128KiB", "--depth", "1,2", "--seconds", "0.05", "--repeat", "2"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"clutor bench-io: writing a 1.00 MiB test file of random bytes in {tmp_path}")
    assert "4 patterns x 1 backend x 2 runs, 0.05 s each: about 0 s" in err
    assert list(tmp_path.iterdir()) == []  # removed afterwards


# -- the disk bound's fio: buffers in huge pages, as Clutor's ---------------------------------------------
def test_fio_takes_huge_pages_only_where_enough_are_reserved(tmp_path):
    from clutor.bench.disk import fio_huge_pages

    def meminfo(free: int) -> str:
        p = tmp_path / f"meminfo{free}"
        p.write_text(f"MemTotal:       24000000 kB\nHugePages_Total:     200\nHugePages_Free:      {free}\n"
                     "Hugepagesize:       2048 kB\n")
        return str(p)

    slab = 2176 << 10  # one 2.125 MiB slab, 32 in flight: 68 MiB = 34 pages, and two more for fio's alignment
    assert fio_huge_pages(slab, 32, meminfo(36))
    assert not fio_huge_pages(slab, 32, meminfo(35))
    assert not fio_huge_pages(slab, 32, meminfo(0))
    assert not fio_huge_pages(slab, 32, str(tmp_path / "absent"))


def _disk_bound_with_stand_in_fio(tmp_path, monkeypatch, first_line: str, *, huge_free: bool):
    """disk_bandwidth on a 256 MiB sparse file, with a stand-in fio on PATH that runs first_line, then
    reports 1 GiB read in 1 s; fio_huge_pages answers huge_free."""
    import clutor.bench.disk as disk
    from clutor.bench.runner import disk_bandwidth

    fio = tmp_path / "bin" / "fio"
    fio.parent.mkdir()
    fio.write_text(f"#!/bin/sh\n{first_line}\n"
                   "echo '{\"jobs\": [{\"read\": {\"runtime\": 1000, \"io_bytes\": 1073741824, \"total_ios\": 512}}]}'\n")
    fio.chmod(0o755)
    model = tmp_path / "m.gguf"
    with open(model, "wb") as f:
        f.truncate(256 << 20)
    monkeypatch.setenv("PATH", f"{fio.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(disk, "fio_huge_pages", lambda block, depth: huge_free)
    return disk_bandwidth(str(model), 1.0, block=2176 << 10, depth=32)


@pytest.mark.parametrize("huge", [True, False])
def test_the_disk_bound_runs_fio_with_huge_page_buffers_when_it_can(tmp_path, monkeypatch, huge):
    """A stand-in fio on PATH records its arguments: --iomem=shmhuge exactly when huge pages are free, and the
    note says which pages fio's buffers were in (a bound measured in small pages is one Clutor may beat)."""
    args = tmp_path / "args"
    d = _disk_bound_with_stand_in_fio(tmp_path, monkeypatch, f"echo \"$@\" > {args}", huge_free=huge)
    assert d.bytes_per_second == float(1 << 30) and d.huge_pages is huge
    assert ("--iomem=shmhuge" in args.read_text().split()) is huge
    assert ("huge pages" in d.note) and (("4 KiB pages" in d.note) is not huge)


def test_the_disk_bound_falls_back_to_small_pages_when_fio_cannot_take_huge_ones(tmp_path, monkeypatch):
    """Huge pages free but refused to fio (shmget's permission): the bound is measured in small pages, and says why."""
    d = _disk_bound_with_stand_in_fio(
        tmp_path, monkeypatch, "case \"$*\" in *shmhuge*) echo 'shmget: Operation not permitted' >&2; exit 1;; esac",
        huge_free=True)
    assert d.bytes_per_second == float(1 << 30) and not d.huge_pages
    assert "4 KiB pages" in d.note and "could not take huge pages" in d.note and "not permitted" in d.note


def test_bench_concurrency_repeat_pairs_each_round_with_its_own_bound(tiny, capsys, monkeypatch):
    """--concurrency with --repeat 3: three rounds, each running every stream count's in-RAM bound beside
    its streamed row (the bound of a noisy machine's slow spell and its row fall in the same round); a row
    is its median round, with that round's bound, and lists every round's tok/s and ratios."""
    real, calls = bench_cli._compute_run, []

    def counted(args, common, streams, progress):
        calls.append(streams)
        return real(args, common, streams, progress)

    monkeypatch.setattr(bench_cli, "_compute_run", counted)
    argv = [tiny, "--concurrency", "1,2", "--budgets", "50%", "--prefetch", "off", "--io", "threads",
            "--tokens", "4", "--prompt-tokens", "8", "--fio-seconds", "0", "--repeat", "3"]
    parser = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers())
    assert bench_cli.run(parser.parse_args(argv + ["--json"])) == 0
    rows = json.loads(capsys.readouterr().out)["concurrency"][0]["rows"]
    assert calls == [1, 2, 1, 2, 1, 2]  # interleaved rounds
    for row in rows:
        assert len(row["rounds"]) == 3
        tps = sorted(r["tps"] for r in row["rounds"])
        assert row["result"]["aggregate_decode_tps"] == tps[1]  # the median round
        mine = next(r for r in row["rounds"] if r["tps"] == tps[1])
        assert row["bounds"]["of_own_bound"] == mine["of_own"]  # ... with its own round's bound
        assert row["compute"]["result"]["aggregate_decode_tps"] > 0
    calls.clear()
    assert bench_cli.run(parser.parse_args(argv)) == 0
    out = capsys.readouterr().out
    assert "rounds (--repeat" in out and out.count(" / ") >= 2 * 3, out


def test_bench_prefix_cache_disk_runs_cold_then_warm_in_a_new_process(tiny, capsys, tmp_path):
    """--prefix-cache-disk: the cold run writes the prompt's pages, the warm one (a new worker process)
    loads them instead of computing them, and the store is removed afterwards."""
    args = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [tiny, "--budgets", "50%", "--prefetch", "off", "--io", "threads", "--tokens", "2", "--prompt-tokens", "100",
         "--fio-seconds", "0", "--no-bounds", "--prefix-cache-disk", str(tmp_path), "--json"])
    assert bench_cli.run(args) == 0
    restart = json.loads(capsys.readouterr().out)["restart"]
    cold, warm = restart["cold"]["result"], restart["warm"]["result"]
    assert cold["stats"]["disk_tokens"] == 0 and cold["disk_cache"]["written"] >= 100 // 16
    assert warm["stats"]["disk_tokens"] == warm["stats"]["cached_tokens"] == 99 // 16 * 16
    assert warm["disk_cache"]["loaded"] >= 99 // 16 and warm["tokens"] == cold["tokens"]
    assert not os.listdir(tmp_path)
    text = rep.render_restart(restart, 1e9)
    assert "warm" in text and "96" in text


def test_bench_during_prefill_measures_other_streams_gaps_inside_the_prefill(tiny, capsys):
    """--during-prefill N: N streams' gaps alone, then those wholly inside a windowed prompt's prefill."""
    args = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [tiny, "--budgets", "50%", "--prefetch", "off", "--io", "threads", "--tokens", "12", "--prompt-tokens", "400",
         "--prefill-window", "400", "--fio-seconds", "0", "--during-prefill", "2", "--json"])
    assert bench_cli.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    res = report["during"][0]["result"]
    assert res["during"] == 2 and res["prompt_tokens"] == 400 and res["prefill_window"] == 400
    assert len(res["gaps_solo"]) == 2 * 11 and all(g > 0 for g in res["gaps_solo"])
    assert all(0 < g <= res["ttft"] for g in res["gaps_during"])
    assert res["stats"]["prompt_windows"] == 1
    assert "during p99" in rep.render_during(report)


def test_bench_speculative_rows_keep_their_tokens(tiny, capsys):
    """--speculative -md DRAFT: each workload with drafts off, n-gram and from the draft model, in RAM and
    streamed, fresh processes; the drafted rows give the same greedy tokens as the rows without, the
    draft model's rows verify drafts, and the streamed rows count their expert bytes."""
    from clutor.cli import bench_spec

    draft = str(fixture_path("olmoe", "Q4_K_M"))
    args = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [tiny, "--budgets", "50%", "--io", "threads", "--tokens", "16", "--fio-seconds", "0", "--cap", "none",
         "--speculative", "-md", draft, "--json"])
    assert bench_cli.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["speculative"]
    assert len(rows) == 2 * 3 * 3 and all(r["ok"] for r in rows)
    assert report["settings"]["model_draft"] == draft
    for r in rows:
        res = r["result"]
        assert len(res["tokens"]) == 16 and res["decode_tps"] > 0
        base = next(q["result"] for q in rows if q["setting"] == r["setting"] and q["workload"] == r["workload"]
                    and q["draft"] == "off")
        assert res["tokens"] == base["tokens"]
        if r["draft"] == "model":
            assert res["drafted"] > 0
        assert (res["decode_bytes"] > 0) == r["streamed"]
    assert "kept / drafted" in bench_spec.render_speculative(report)

"""Regression tests for what an adversarial read of Clutor found (crashes, lost files, leaks, unbounded
allocations, hangs): each test reproduces one finding and asserts the clean outcome instead."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import clutor
from clutor.errors import BudgetError, ClutorError, ClutorIOError, ModelFileError
from clutor.io.layout import ExpertLayout, ExpertTensor
from clutor.io.store import _geometry
from clutor.io.arena import widen
from clutor.io.trace import TraceHeader, TraceWriter, read_trace
from clutor.model.chat import render_chat
from clutor.model.arch import read_arch
from clutor.model.gguf import GGUFFile
from clutor.model.weights import expert_layout
from clutor.model.layers import Rope
from clutor.model.tokenizer import Tokenizer
from conftest import fixture_path, run, run_on_loop, tiny_demo_spec

REPO = Path(__file__).resolve().parents[1]
MODEL = fixture_path("olmoe", "Q8_0")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


# -- 1. SIGBUS: io="memory" on a file truncated while open -----------------------------------------
def test_truncated_file_with_io_memory_is_an_error_not_a_dead_process(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    # In a child: before the fix the process died of SIGBUS (exit 135) and took pytest with it.
    p = _child(f"""
        import asyncio, os, clutor
        async def main():
            async with clutor.Model.open({str(model)!r}, io="memory") as m:
                await m.logits([1, 2, 3])                      # pages mapped and used
                os.truncate({str(model)!r}, os.path.getsize({str(model)!r}) // 2)
                try:
                    await m.logits([1, 2, 3])
                except clutor.ClutorIOError as e:
                    print("ClutorIOError", e)
        asyncio.run(main())
    """)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.startswith("ClutorIOError") and "truncated" in p.stdout and str(model) in p.stdout


# -- 2. --trace never destroys a file -------------------------------------------------------------
def test_trace_refuses_the_model_file(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    before = _sha(model)

    async def go():
        async with clutor.Model.open(model, trace=model, expert_cache="50%"):
            pass

    with pytest.raises(ClutorError, match="over the model file"):
        run(go())
    assert _sha(model) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary file left


def test_trace_refuses_a_part_of_a_split_model(tmp_path):
    from test_split_model import split_copy

    first = split_copy(fixture_path("qwen3moe", "Q8_0"), tmp_path, 3)
    part2 = tmp_path / "m-00002-of-00003.gguf"
    before = _sha(part2)

    async def go():
        async with clutor.Model.open(first, trace=part2, expert_cache="50%"):
            pass

    with pytest.raises(ClutorError, match="over the model file"):
        run(go())
    assert _sha(part2) == before


def test_trace_refuses_an_existing_file_that_is_not_a_trace_and_replaces_a_trace(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(ClutorError, match="not a routing trace"):
        TraceWriter(notes, TraceHeader(2, 8, 2))
    assert notes.read_text() == "my notes\n"
    for special in ("/dev/full", "/dev/null"):
        if os.path.exists(special):
            with pytest.raises(ClutorError, match="not a regular file"):
                TraceWriter(special)
    # an old trace is replaced, but only when the new one is complete
    trace = tmp_path / "t.jsonl"
    with TraceWriter(trace, TraceHeader(2, 8, 2)) as w:
        w.write(0, 0, [1, 2])
    old = trace.read_text()
    w = TraceWriter(trace, TraceHeader(2, 8, 2))
    w.write(0, 0, [3, 4])
    assert trace.read_text() == old  # nothing visible before close
    w.abort()
    assert trace.read_text() == old and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "t.jsonl"]
    with TraceWriter(trace, TraceHeader(2, 8, 2)) as w:
        w.write(0, 0, [3, 4])
    assert read_trace(trace).records[0].experts == (3, 4)


def test_cli_trace_over_the_model_is_refused(tmp_path, capsys):
    from clutor.cli import main

    model = tmp_path / "M.gguf"
    shutil.copy(MODEL, model)
    before = _sha(model)
    assert main(["generate", str(model), "hi", "-n", "2", "--trace", str(model)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("clutor: error: ") and err.count("\n") == 1 and "model file" in err
    assert _sha(model) == before


# -- 3. nothing leaks when open or close fails ----------------------------------------------------
@pytest.mark.parametrize("io", ["auto", "threads", "memory"])
def test_failure_inside_model_init_closes_every_fd(monkeypatch, io):
    import clutor.model.model as mm

    def boom(*a, **k):
        raise MemoryError("simulated: an allocation in Model.__init__ did not fit")

    monkeypatch.setattr(mm, "Engine", boom)  # built last in Model.__init__

    async def go():
        before = _open_fds()
        with pytest.raises(MemoryError):
            await clutor.Model.open(MODEL, io=io, expert_cache="50%")
        return before

    before = run(go())
    assert _open_fds() <= before  # GGUF fd, eventfd and io_uring fd all closed


def test_aclose_closes_everything_when_the_trace_close_fails(tmp_path, monkeypatch):
    async def go():
        before = _open_fds()
        model = await clutor.Model.open(MODEL, trace=tmp_path / "t.jsonl", expert_cache="50%")
        await model.logits([1, 2])

        def replace(src, dst):  # publishing the trace fails (a read-only directory by now, say)
            raise OSError(30, "Read-only file system")

        monkeypatch.setattr("clutor.io.trace.os.replace", replace)
        with pytest.raises(ClutorError, match="Read-only"):
            await model.aclose()
        await model.aclose()  # a second close is a no-op, not an error
        return before

    before = run(go())
    assert _open_fds() <= before
    assert list(tmp_path.iterdir()) == []  # the unfinished trace is removed, not published


def test_trace_on_a_full_disk_stops_tracing_and_generation_goes_on(tmp_path):
    # A real write failure: the child's file-size limit (RLIMIT_FSIZE) is set just above the trace's
    # size, so its next writes fail with EFBIG as on a full disk; later the limit is lifted again.
    trace = tmp_path / "t.jsonl"
    r = _child(f"""
        import asyncio, glob, logging, os, resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        import clutor
        from clutor.io.trace import TraceWriter
        TraceWriter.FLUSH_BYTES = 1024  # write often, so the limit is met within a few tokens

        async def main():
            async with clutor.Model.open({str(MODEL)!r}, trace={str(trace)!r}, expert_cache="50%", io="threads") as m:
                async def gen():
                    out = [c async for c in m.generate("Hello there", max_tokens=12, temperature=0, ignore_eos=True)]
                    return out[-1].stats.generated_tokens
                assert await gen() == 12
                tmp, = glob.glob({str(tmp_path)!r} + "/.t.jsonl.*.tmp")
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(tmp) + 1024, hard))
                assert [await gen() for _ in range(6)] == [12] * 6  # the disk fills: generation goes on
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
                assert await gen() == 12
                w = m._trace
                print("KEPT", w.kept, "DROPPED", w.dropped)
        asyncio.run(main())
    """)
    assert r.returncode == 0, r.stderr
    kept = int(r.stdout.split()[1])
    assert int(r.stdout.split()[3]) > 0, "nothing was dropped: the limit never bit"
    warnings = [line for line in r.stderr.splitlines() if "cannot write the routing trace" in line]
    assert len(warnings) == 1, r.stderr  # one warning, not one per record or per request
    assert "File too large" in warnings[0]
    tr = read_trace(trace)  # what was written is kept, whole lines only, and reads back
    assert len(tr.records) == kept > 0
    assert not list(tmp_path.glob(".t.jsonl.*"))


# -- 4. what a file or an option can make Clutor allocate -----------------------------------------
def test_rope_has_no_context_sized_table():
    rope = Rope(128, 10000.0, 1 << 24)
    assert sum(v.nbytes for v in vars(rope).values() if isinstance(v, np.ndarray)) <= 128 * 8
    x = np.random.default_rng(0).standard_normal((3, 2, 128)).astype(np.float32)
    p0 = (1 << 24) - 3
    got = rope(x, p0)
    inv = 10000.0 ** (-np.arange(64) * 2.0 / 128)
    ang = (p0 + np.arange(3))[:, None, None] * inv[None, None, :]
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    want = np.concatenate([x[..., :64] * c - x[..., 64:] * s, x[..., 64:] * c + x[..., :64] * s], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        rope(x, 1 << 24)  # past the context


def test_absurd_head_dim_and_vocab_are_named_errors():
    from clutor.model.arch import read_config

    with GGUFFile.open(MODEL) as f:
        f.metadata["olmoe.attention.key_length"] = 65536
        with pytest.raises(ModelFileError, match="attention.key_length"):
            read_config(f)
        meta = dict(f.metadata)
    meta["tokenizer.ggml.tokens"] = ["a"] * ((1 << 20) + 1)
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens.*at most"):
        Tokenizer.from_metadata(meta, "vocab.gguf")


def test_kv_cache_that_cannot_be_mapped_is_a_budget_error():
    from clutor.model.kv import KVPool
    from clutor.model.state import FullKV

    with pytest.raises(BudgetError, match="kv_cache"):
        KVPool([FullKV(1 << 10, 4096, 4096)] * (1 << 12), n_ctx=1 << 24, budget=1 << 60)  # 2^60 bytes of address space


# -- 5. templates are bounded ---------------------------------------------------------------------
@pytest.mark.parametrize("template, why", [
    ("{{ range(10**9)|list }}", "argument"),
    ("{{ range(200000)|list }}", "Range too big"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
    ("{{ 'a' * 10**10 }}", "repetition"),
    ("{{ 'x'|center(10**10) }}", "argument"),
    ("{{ 'x'.ljust(10**10) }}", "argument"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "concatenation"),
    ("{% set ns = namespace(s=[]) %}{% for i in range(100000) %}{% set ns.s = ns.s + ['x' * 4000000] %}{% endfor %}",
     "grew the process"),
    ("{{ '%99999999999s' % 1 }}", "width"),
])
def test_template_that_would_not_end_or_fit_is_a_clutor_error(template, why):
    t0 = time.monotonic()
    with pytest.raises(ClutorError, match="my-template.jinja") as e:
        render_chat(template, [{"role": "user", "content": "hi"}], name="my-template.jinja")
    assert why in str(e.value)
    assert time.monotonic() - t0 < 30


def test_template_bounds_leave_real_templates_alone():
    convo = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 50} for i in range(200)]
    tpl = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    out = render_chat(tpl, convo)
    assert out.count("<|im_start|>") == 201 and out.endswith("<|im_start|>assistant\n")
    before = sys.gettrace()  # the caller's own tracer (a debugger, coverage) is put back
    render_chat(tpl, convo)
    assert sys.gettrace() is before


def test_bounded_rendering_gives_what_the_stock_sandbox_gives():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from clutor.model.chat import _tojson

    from conftest import shared_data

    templates = sorted(shared_data("templates").glob("*.jinja"))
    assert templates, "no .jinja file in ../shared/data/templates"
    stock = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    stock.filters["tojson"] = _tojson
    convo = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} ~ {{x}} " * 3} for i in range(9)]
    for path in templates:
        text = path.read_text()
        if "strftime_now" in text:
            continue  # the date differs between two renders at midnight; nothing else to learn from it
        want = stock.from_string(text).render(messages=convo, add_generation_prompt=True, bos_token="<s>",
                                              eos_token="</s>", raise_exception=None)
        assert render_chat(text, convo, bos_token="<s>", eos_token="</s>") == want, path.name


# -- 6. no hang on a FIFO -------------------------------------------------------------------------
@pytest.mark.timeout(20)
def test_fifo_as_model_or_split_part_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match="regular"):
        GGUFFile.open(fifo)
    from test_split_model import split_copy

    first = split_copy(fixture_path("qwen3moe", "Q8_0"), tmp_path, 2)
    part2 = tmp_path / "m-00002-of-00002.gguf"
    part2.unlink()
    os.mkfifo(part2)
    with pytest.raises(ModelFileError, match="regular"):
        GGUFFile.open(first)


# -- 7. every failed read of a batch is retrieved -------------------------------------------------
def test_two_failed_reads_log_nothing(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)

    async def go():
        async with clutor.Model.open(model, io="threads", direct=False, expert_cache="50%") as m:
            os.truncate(model, os.path.getsize(model) // 2)  # every expert of layer 0 past the end
            with pytest.raises(ClutorIOError):
                await m.logits([1, 2, 3, 4, 5, 6])

    run_on_loop(go)  # fails if the loop logged "Future exception was never retrieved"


# -- 8. parser gaps and slot geometry -------------------------------------------------------------
def test_pre_as_array_and_float_token_types_are_named_errors():
    with GGUFFile.open(MODEL) as f:
        meta = dict(f.metadata)
    bad = dict(meta, **{"tokenizer.ggml.pre": ["gpt-2"]})
    with pytest.raises(ModelFileError, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata(bad, "m.gguf")
    n = len(meta["tokenizer.ggml.tokens"])
    bad = dict(meta, **{"tokenizer.ggml.token_type": [1.0] * (n - 1) + [float("inf")]})
    with pytest.raises(ModelFileError, match="token_type"):
        Tokenizer.from_metadata(bad, "m.gguf")


def _brute_region(t: ExpertTensor, n: int, align: int) -> int:
    return max(widen(t.offset + e * t.slab_bytes, t.slab_bytes, align)[1] for e in range(n))


@pytest.mark.parametrize("seed", range(20))
def test_slot_geometry_matches_every_expert(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    align = int(rng.choice([512, 4096]))
    layers = []
    for _ in range(int(rng.integers(1, 5))):
        layers.append(tuple(ExpertTensor("m", int(rng.integers(0, 1 << 20)) * 32,
                                         int(rng.choice([align * int(rng.integers(1, 9)), int(rng.integers(1, 20000)) * 2])))
                            for _ in range(3)))
    layout = ExpertLayout(n, tuple(layers))
    geo = _geometry(layout, align)
    want = [max(_brute_region(layer[p], n, align) for layer in layers) for p in range(3)]
    assert list(geo.region) == want


@pytest.mark.timeout(60)
def test_slot_geometry_of_4096_layers_by_4096_experts():
    # 50M (layer, expert, part) combinations: the old per-expert loop took most of a minute here
    layers = tuple((ExpertTensor("m", 32 * (3 * l), 1000), ExpertTensor("m", 32 * (3 * l + 1), 1000),
                    ExpertTensor("m", 32 * (3 * l + 2), 3000)) for l in range(4096))
    geo = _geometry(ExpertLayout(4096, layers), 4096)
    assert geo.region == (8192, 8192, 8192)


# -- 9. demo model temp files ---------------------------------------------------------------------
def test_demo_build_removes_dead_runs_temp_files_and_keeps_live_ones(tmp_path):
    from clutor.cli.demo_model import ensure_demo_model

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tiny-olmoe-0123456789abcdef.gguf.{dead.pid}.abc123.tmp"
    live = tmp_path / f".tiny-olmoe-0123456789abcdef.gguf.{os.getpid()}.def456.tmp"
    stale.write_bytes(b"x" * 1000)
    live.write_bytes(b"x" * 1000)
    path = ensure_demo_model(tmp_path, spec=tiny_demo_spec())
    assert path.exists() and not stale.exists() and live.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{path.name}")]


@pytest.mark.timeout(120)
def test_demo_ctrl_c_stops_the_build_and_leaves_nothing(tmp_path):
    import signal

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.Popen([sys.executable, "-c", "import sys; from clutor.cli import main; sys.exit(main())",
                          "demo", "--cache-dir", str(tmp_path)], env=env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not list(tmp_path.glob(".*.tmp")):  # the build has started
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["file", "readonly"])
def test_demo_cache_dir_unwritable_is_one_line(tmp_path, capsys, bad):
    from clutor.cli import main

    target = tmp_path / "cache"
    if bad == "file":
        target.write_text("x")
    else:
        if os.geteuid() == 0:
            pytest.skip("root can write into a read-only directory")
        target.mkdir()
        target.chmod(0o500)
    try:
        assert main(["demo", "--cache-dir", str(target), "-n", "1"]) == 1
    finally:
        if target.is_dir():
            target.chmod(0o700)
    err = capsys.readouterr().err
    assert err.startswith("clutor: error: ") and err.count("\n") == 1 and str(target) in err


# -- 10. expert cache sizes -----------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["1e30", "99999999999999999999GiB", "100GiB", 10**30])
def test_absurd_expert_cache_is_capped_at_all_experts(spec):
    async def go():
        async with clutor.Model.open(MODEL, expert_cache=spec, io="threads") as m:
            store = m._experts
            all_experts = store.layout.n_layers * store.layout.n_experts * store.slot_bytes
            assert store.budget == all_experts and "capped at what all experts need" in m.cache_note
            await m.logits([1, 2, 3])

    run(go())


def test_expert_cache_note_quotes_the_request():
    from clutor.model.options import resolve_budget

    with GGUFFile.open(MODEL) as f:
        layout = expert_layout(f, read_arch(f))
    budget, why = resolve_budget("1MiB", layout, 2, 0)
    assert budget == 1 << 20 and why == "as asked: 1MiB = 1.00 MiB"


# -- a streamed step waits on the loop's reads: an interpreter that exits with the loop stopped ---------
def test_exit_with_the_loop_stopped_mid_generation_does_not_hang():
    """A streamed generation's steps run on the compute thread and wait there for the event loop to take
    their reads' completions. A program that stops running its loop mid-generation and exits (the loop
    never closed) must still exit: the interpreter joins the compute thread, whose wait sees the exit and
    fails the step instead of waiting for a loop that will never run again."""
    p = _child(f"""
        import asyncio, os, time, clutor
        loop = asyncio.new_event_loop()
        model = loop.run_until_complete(clutor.Model.open({str(MODEL)!r}, io="threads", expert_cache="30%"))
        gen = model.generate("Once upon a time", max_tokens=500, ignore_eos=True, temperature=0)
        loop.run_until_complete(gen.__anext__())      # the first token; the decode goes on on the compute thread
        time.sleep(0.5)                               # ... until it waits for a read the stopped loop never takes
        print("exiting", flush=True)
    """, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "exiting" in p.stdout

"""The model streaming its routed experts through the ExpertStore (issue "Streaming").

- exactness: every backend / O_DIRECT / prefetch combination gives the io="memory" logits bit for bit,
  with a cache so small that experts are evicted every token and prefills are served in chunks;
- memory: a model whose experts are ~1.6x a cgroup cap (and 6x the expert cache) generates inside it;
- concurrency, budget parsing and errors, routing traces replayed by the simulator, prefetch effect.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import clutor
import streaming_util as su
from clutor.bench import memcap
from clutor.io.simulate import simulate, slots_for_budget
from clutor.io.trace import read_trace
from clutor.model.arch import read_arch, read_config
from clutor.model.gguf import GGUFFile
from clutor.model.weights import expert_layout
from clutor.model.options import slot_bytes
from synth import ModelSpec, plan_tensors, write_model
from clutor.units import format_bytes
from conftest import SHARED_DATA, fixture_path, run, shared_data

ARCHS = ("olmoe", "qwen2moe", "qwen3moe")
QTYPES = ("Q8_0", "F16")
IOS = ("threads", "uring")
PROMPT_LEN = 48   # tokens of the all-positions prefill: touches every expert of the tiny models
N_DECODE = 16     # greedy decode steps, one token each
ROOM = 5          # "room" cache: 5 slots of 16 experts (4 slots + 1 spare), enough for a prefetch slot

# What the process needs besides dense weights, expert cache and KV cache. Measured on this machine
# (python 3.11, numpy 2.4, numba 0.68 with its kernel cache warm, clutor, then a streamed 4-token
# generation on tiny-olmoe-Q8_0; `python tests/streaming_util.py baseline tests/fixtures/tiny-olmoe-Q8_0.gguf`):
# VmHWM 180 MiB = 79 MiB anonymous + 100 MiB file-backed (libopenblas, llvmlite, numpy's .so files).
# The margin covers per-matmul temporaries at n_embd 1024 (a dequantised 1024x1024 f32 matrix is
# 4 MiB), page tables, io_uring rings and run-to-run noise. The test re-measures it and fails first
# (with the figure) if the runtime has outgrown this constant.
RUNTIME_ALLOWANCE = 256 << 20
BIG_CACHE = 96 << 20  # the expert cache of the capped runs


# -- shared helpers -------------------------------------------------------------------------------
def _prompt(n: int, n_vocab: int = 512, seed: int = 7) -> list[int]:
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


def _direct_ok(path: str | os.PathLike) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


_URING: list[str | None] = []


def _uring_unavailable() -> str | None:
    """Why io_uring cannot be used here (None when it can); probed once per session."""
    if not _URING:
        async def probe():
            try:
                async with clutor.Model.open(fixture_path("olmoe", "Q8_0"), io="uring", expert_cache="50%"):
                    return None
            except clutor.ClutorError as e:
                return str(e)
        _URING.append(run(probe()))
    return _URING[0]


def _need(io: str) -> None:
    if io == "uring" and (why := _uring_unavailable()):
        pytest.skip(f"io_uring unavailable here: {why}")


def _minimum(path) -> tuple[int, int]:
    """(the smallest expert_cache the model accepts, one slot's bytes), as Model.open computes them."""
    with GGUFFile.open(path) as f:
        cfg = read_config(f)
        slot = slot_bytes(expert_layout(f, read_arch(f)))
    return cfg.n_expert_used * slot, slot


@dataclass
class Outcome:
    full: np.ndarray       # [PROMPT_LEN, V] logits of the all-positions prefill
    steps: np.ndarray      # [N_DECODE + 1, V] last logits of a short prefill, then of each decode step
    tokens: list[int]      # the greedy tokens
    prefill_io: object     # StoreStats before / after the all-positions prefill, and at the end
    start_io: object
    end_io: object
    n_layers: int          # layers with routed experts


async def _outcome(path, prompt: list[int], **opts) -> Outcome:
    async with clutor.Model.open(path, **opts) as model:
        start = model.io_stats()
        full = await model.logits(prompt)
        mid = model.io_stats()
        seq = model.new_sequence()
        steps = [(await model.forward(seq, prompt[:6]))[-1]]
        tokens = []
        for _ in range(N_DECODE):
            tokens.append(int(np.argmax(steps[-1])))
            steps.append((await model.forward(seq, [tokens[-1]]))[-1])
        return Outcome(full, np.stack(steps), tokens, mid, start, model.io_stats(), len(model.config.moe_layers))


_REF: dict[tuple[str, str], Outcome] = {}


def _reference(arch: str, qtype: str) -> Outcome:
    if (arch, qtype) not in _REF:
        _REF[arch, qtype] = run(_outcome(fixture_path(arch, qtype), _prompt(PROMPT_LEN), io="memory"))
    return _REF[arch, qtype]


# -- 1. exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_logits_equal_memory_bit_for_bit(arch, qtype, io):
    _need(io)
    path = fixture_path(arch, qtype)
    ref = _reference(arch, qtype)
    minimum, slot = _minimum(path)
    direct_possible = _direct_ok(path)
    configs = []
    for direct in (True, False):
        configs += [(direct, False, minimum), (direct, True, minimum), (direct, True, ROOM * slot)]
    for direct, prefetch, cache in configs:
        what = f"{arch}-{qtype} io={io} direct={direct} prefetch={prefetch} cache={cache // slot} slots"
        got = run(_outcome(path, _prompt(PROMPT_LEN), io=io, direct=direct, prefetch=prefetch, expert_cache=cache))
        assert np.array_equal(got.full, ref.full), f"{what}: prefill logits differ from io=memory"
        assert np.array_equal(got.steps, ref.steps), f"{what}: decode logits differ from io=memory"
        assert got.tokens == ref.tokens, what
        end, pre, start = got.end_io, got.prefill_io, got.start_io
        assert end.backend == io, what
        assert end.mode == ("direct" if direct and direct_possible else "buffered"), what
        assert end.arena_bytes <= cache, what
        # The cache streamed: far fewer slots than the 16 experts, so experts were read and evicted.
        assert end.misses > 0 and end.evictions > 0, f"{what}: {end}"
        assert end.bytes_demand > 0, what
        # The prefill needed more distinct experts in some layer than the store can pin at once
        # (one get() of that many raises BudgetError), so it was served in chunks.
        room = end.arena_bytes // end.slot_bytes
        assert pre.accesses - start.accesses > got.n_layers * room, f"{what}: prefill was not chunked"
        if prefetch and cache > minimum:
            assert end.prefetch_issued > 0, f"{what}: prefetch never issued: {end}"
        if not prefetch:
            assert end.prefetch_issued == 0, f"{what}: {end}"


# -- 2. memory: a model larger than the cap generates inside it -------------------------------------
@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """~640 MiB olmoe-shaped Q8_0 model (612 MiB of routed experts), on a filesystem with O_DIRECT."""
    if why := memcap.unavailable_reason():
        pytest.skip(f"cgroup memory caps unavailable: {why}")
    d = tmp_path_factory.mktemp("big")
    probe = d / "probe"
    probe.write_bytes(b"\0" * 4096)
    fallback = not _direct_ok(probe)
    if fallback:
        d = Path(f"/var/tmp/clutor-streaming-{os.getpid()}")
        d.mkdir(exist_ok=True)
    path = d / "big.gguf"
    spec = su.big_spec()
    try:
        write_model(path, spec, seed=1)
        yield path, spec
    finally:  # 640 MiB: do not leave it in pytest's kept tmp dirs
        path.unlink(missing_ok=True)
        if fallback:
            d.rmdir()


def _capped_json(result: memcap.CapResult) -> dict:
    lines = [l for l in result.stdout.splitlines() if l.startswith("{")]
    assert result.returncode == 0 and lines, (
        f"child failed: rc={result.returncode} oom={result.oom_killed} peak={format_bytes(result.peak)} "
        f"cap={format_bytes(result.limit)}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def test_generation_fits_in_a_cgroup_cap_far_below_the_model(big_model):
    path, spec = big_model
    plans = plan_tensors(spec)
    expert_bytes = sum(p.nbytes for p in plans if "_exps." in p.name)
    dense_bytes = sum(p.nbytes for p in plans if "_exps." not in p.name)
    kv_bytes = 2 * spec.n_layer * spec.n_head_kv * spec.n_ctx * spec.head_dim * 4  # float32 K and V
    cap = dense_bytes + BIG_CACHE + kv_bytes + RUNTIME_ALLOWANCE
    assert expert_bytes >= 4 * BIG_CACHE and expert_bytes > cap, (format_bytes(expert_bytes), format_bytes(cap))
    env = su.child_env()

    # The runtime's own footprint, measured now: the first run also fills numba's on-disk kernel
    # cache, so that no capped child pays LLVM's compile-time memory; the second one is the figure.
    tiny = str(fixture_path("olmoe", "Q8_0"))
    for _ in range(2):
        p = subprocess.run(su.child_cmd("baseline", tiny), capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    base = json.loads(p.stdout.splitlines()[-1])
    runtime = base["os"]["vm_hwm"] - base["dense_bytes"] - base["cache_bytes"]
    assert runtime <= RUNTIME_ALLOWANCE, (
        f"the runtime alone now peaks at {format_bytes(runtime)} (VmHWM {format_bytes(base['os']['vm_hwm'])}): "
        f"raise RUNTIME_ALLOWANCE ({format_bytes(RUNTIME_ALLOWANCE)})")

    tokens = {}
    for io in IOS:
        if io == "uring" and _uring_unavailable():
            continue
        # ru_maxrss survives exec: it starts at this (forked) process's resident size, so it is
        # max(the child's peak, our size at fork), which grows with the number of tests run before.
        # Only anonymous memory counts: fork copies its page tables, not those of mapped files.
        parent_rss = su.proc_status()["RssAnon"]
        r = memcap.run_capped(su.child_cmd("generate", str(path), "--io", io, "--cache", str(BIG_CACHE), "--tokens", "8"),
                              cap, env=env, timeout=300)
        what = f"io={io} cap={format_bytes(cap)} cgroup peak={format_bytes(r.peak)}"
        assert not r.oom_killed, what
        out = _capped_json(r)
        tokens[io] = out["tokens"]
        assert len(out["tokens"]) == 8, what
        assert r.peak <= cap, what
        io_rep = out["io"]
        assert io_rep["backend"] == io and io_rep["mode"] == "direct", (what, io_rep)
        assert io_rep["cache_bytes"] <= BIG_CACHE, (what, io_rep)
        assert io_rep["misses"] > 0 and out["evictions"] > 0, (what, out)
        # The reported peak is the kernel's: VmHWM and getrusage's ru_maxrss, read in the child after
        # the run without clutor's help, agree within 10% or 4 MiB.
        osf = out["os"]
        tol = max(0.10 * osf["vm_hwm"], 4 << 20)
        assert abs(out["peak_rss"] - osf["vm_hwm"]) <= tol, (what, out)
        # ru_maxrss is at least the child's own peak (it also carries the forked parent's size, which
        # grows with the tests run before, so it can only be bounded from below).
        assert osf["ru_maxrss"] >= out["peak_rss"] - tol, (what, out, parent_rss)
        # Read just after generating, the child's anonymous memory holds the whole (touched) arena, and
        # all of it is charged to the cgroup: the cap really applied to this process.
        assert io_rep["cache_bytes"] <= osf["rss_anon"] <= r.peak, (what, osf)
        assert out["peak_rss"] - osf["rss_file"] <= cap, (what, out)
    if len(tokens) == 2:
        assert tokens["threads"] == tokens["uring"]

    # Negative control: the same cap really binds. The whole model in anonymous memory is OOM-killed.
    # (An mmap of it would not be: file pages are reclaimable page cache; it would just be slow.)
    r = memcap.run_capped(su.child_cmd("slurp", str(path)), cap, env=env, timeout=300)
    assert r.returncode != 0 and r.oom_killed, (r.returncode, r.oom_killed, r.stdout, r.stderr[-1000:])


def test_eight_concurrent_sequences_fit_in_a_cgroup_cap(big_model):
    """Eight generations in one batch: the cap is the one-sequence cap plus seven more KV caches."""
    path, spec = big_model
    plans = plan_tensors(spec)
    dense_bytes = sum(p.nbytes for p in plans if "_exps." not in p.name)
    kv_bytes = 2 * spec.n_layer * spec.n_head_kv * spec.n_ctx * spec.head_dim * 4  # float32 K and V, one sequence
    cap = dense_bytes + BIG_CACHE + 8 * kv_bytes + RUNTIME_ALLOWANCE
    io = "threads"
    r = memcap.run_capped(su.child_cmd("generate", str(path), "--io", io, "--cache", str(BIG_CACHE), "--tokens", "8",
                                       "--concurrency", "8"), cap, env=su.child_env(), timeout=300)
    what = f"8 sequences, io={io} cap={format_bytes(cap)} cgroup peak={format_bytes(r.peak)}"
    assert not r.oom_killed, what
    out = _capped_json(r)
    assert [len(t) for t in out["streams"]] == [8] * 8, what
    assert len({tuple(t) for t in out["streams"]}) > 1, what  # different prompts, different tokens
    assert out["steps"] < 8 * 8, (what, out["steps"])  # they shared steps
    assert r.peak <= cap, what
    assert out["io"]["misses"] > 0 and out["evictions"] > 0, (what, out)


# -- 3. concurrency -------------------------------------------------------------------------------
PROMPTS = ("Once upon a time there was a little", "The quick brown fox jumps over the lazy")


async def _collect(model, prompt: str, log: list, tag: int) -> tuple[list[int], str]:
    tokens, text = [], []
    async for out in model.generate(prompt, max_tokens=N_DECODE, temperature=0, ignore_eos=True):
        log.append(tag)
        text.append(out.text)
        if out.token is not None:
            tokens.append(out.token)
    return tokens, "".join(text)


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("cache_slots", [None, ROOM], ids=["min-cache", "room-cache"])
def test_two_generations_at_once_equal_their_solo_runs(io, cache_slots):
    _need(io)
    path = fixture_path("qwen2moe", "Q8_0")
    minimum, slot = _minimum(path)
    cache = minimum if cache_slots is None else cache_slots * slot

    async def go():
        async with clutor.Model.open(path, io="memory") as ref:
            mem = [await _collect(ref, p, [], 0) for p in PROMPTS]
        async with clutor.Model.open(path, io=io, expert_cache=cache, prefetch=True) as model:
            solo = [await _collect(model, p, [], 0) for p in PROMPTS]
            log: list[int] = []
            both = await asyncio.gather(*(_collect(model, p, log, i) for i, p in enumerate(PROMPTS)))
            return mem, solo, list(both), log, model.io_stats()

    mem, solo, both, log, stats = run(go())
    assert solo == mem
    assert both == solo
    assert solo[0][0] != solo[1][0]  # different prompts, different continuations
    assert len(log) == 2 * (N_DECODE + 1)
    # They really ran together: the second consumer got a record before the first one finished.
    assert log.index(1) < len(log) - 1 - log[::-1].index(0), log
    assert stats.misses > 0 and stats.evictions > 0


# -- 4. budget ------------------------------------------------------------------------------------
def test_budget_minimum_shares_and_sizes():
    path = fixture_path("olmoe", "Q8_0")
    minimum, slot = _minimum(path)

    async def opened(**opts):
        async with clutor.Model.open(path, io="threads", **opts) as model:
            return model.io_stats()

    for below in (minimum - 1, minimum // 2, "1KiB"):
        with pytest.raises(clutor.BudgetError) as e:
            run(opened(expert_cache=below))
        assert str(minimum) in str(e.value), str(e.value)  # the message states the minimum, in bytes
    assert run(opened(expert_cache=minimum)).arena_bytes <= minimum

    total = 2 * 8 * slot  # tiny-olmoe: 2 layers x 8 experts
    st = run(opened(expert_cache="25%"))
    assert 0 < st.arena_bytes <= total // 4 and st.n_slots >= 1
    st = run(opened(expert_cache="3MiB"))
    assert 0 < st.arena_bytes <= 3 << 20 and st.arena_bytes > (3 << 20) - 2 * slot
    with pytest.raises(clutor.BudgetError):
        run(opened(expert_cache="1%"))  # a share below the minimum is refused the same way

    for bad in ("lots", "0%", "150%", "-5MiB"):
        with pytest.raises(clutor.ClutorError):
            run(opened(expert_cache=bad))

    async def bogus_io():
        async with clutor.Model.open(path, io="bogus"):
            pass

    with pytest.raises(clutor.ClutorError, match="bogus"):
        run(bogus_io())


# -- 5. trace -------------------------------------------------------------------------------------
def test_trace_has_one_record_per_layer_and_token_and_replays(tmp_path):
    path = fixture_path("olmoe", "Q8_0")
    minimum, slot = _minimum(path)
    trace_path = tmp_path / "routing.jsonl"
    prompt, n_gen = _prompt(12), 6

    async def go():
        async with clutor.Model.open(path, io="threads", expert_cache=ROOM * slot, prefetch=False,
                                     trace=trace_path) as model:
            toks = [o.token async for o in model.generate(prompt, max_tokens=n_gen, temperature=0, ignore_eos=True)
                    if o.token is not None]
            return model.config, toks

    cfg, toks = run(go())
    assert len(toks) == n_gen
    trace = read_trace(trace_path)
    assert trace.header is not None
    assert (trace.header.n_layers, trace.header.n_experts, trace.header.top_k) == (
        cfg.n_layers, cfg.n_expert, cfg.n_expert_used)
    processed = len(prompt) + n_gen - 1  # the last sampled token is never fed back
    assert len(trace) == cfg.n_layers * processed
    per_token: dict[int, list[int]] = {}
    for r in trace.records:
        per_token.setdefault(r.token, []).append(r.layer)
        assert len(set(r.experts)) == cfg.n_expert_used
        assert r.weights is not None and len(r.weights) == cfg.n_expert_used
    assert sorted(per_token) == list(range(processed))
    assert all(sorted(layers) == list(range(cfg.n_layers)) for layers in per_token.values())

    res = simulate(trace, ROOM - 1, "lru")
    assert res.accesses == len(trace) * cfg.n_expert_used and res.hits + res.misses == res.accesses
    assert res.misses > 0 and res.evictions > 0


def test_simulator_predicts_the_store_exactly_on_single_token_steps(tmp_path):
    """One token per forward, no prefetch: each trace record is one get(). Replayed through the
    simulator in the order the model asks the store for experts, the counts must be the store's."""
    path = fixture_path("qwen3moe", "Q8_0")
    minimum, slot = _minimum(path)
    trace_path = tmp_path / "steps.jsonl"

    async def go():
        async with clutor.Model.open(path, io="threads", expert_cache=8 * slot, prefetch=False, policy="lru",
                                     trace=trace_path) as model:
            seq = model.new_sequence()
            for tok in _prompt(40, seed=11):
                await model.forward(seq, [tok])
            return model.io_stats()

    st = run(go())
    trace = read_trace(trace_path)
    # For one token, the model asks the store for its experts in router order: the trace's order.
    res = simulate(trace, st.n_slots, "lru")
    assert (res.accesses, res.hits, res.misses, res.evictions) == (st.accesses, st.hits, st.misses, st.evictions)
    assert st.hits > 0 and st.evictions > 0


REAL_MODEL = SHARED_DATA / "models" / "real-olmoe-q8_0.gguf"
# Held-out text for the real model (its own routing has real reuse); not the text of the README's table.
REAL_TEXT = (
    "def parse(path, strict=False):\n    with open(path) as f:\n        for line in f:\n"
    "            if not line.strip():\n                continue\n            yield line.split()\n\n"
    "The licence grants permission to copy and distribute the software, provided that the notice "
    "above is kept in every copy.\n\nstatic inline int clamp(int v, int lo, int hi) { return v < lo ? lo : v; }\n"
)


@pytest.mark.parametrize("policy", ["forecast", "lrfu"])
def test_simulator_predicts_the_store_exactly_with_predictions(tmp_path, policy):
    """Decode steps of the real-text model through a small cache: the store is told each next layer's
    predicted experts (hint) and the trace records them (version 2); replaying the trace must give the
    store's counts exactly, for a policy that uses the hints and for one that does not."""
    shared_data("models/real-olmoe-q8_0.gguf")
    minimum, slot = _minimum(REAL_MODEL)
    trace_path = tmp_path / "real.jsonl"

    async def go():
        async with clutor.Model.open(REAL_MODEL, io="threads", expert_cache=40 * slot, prefetch=False,
                                     policy=policy, trace=trace_path) as model:
            seq = model.new_sequence()
            for tok in model.tokenizer.encode(REAL_TEXT)[:120]:
                await model.forward(seq, [tok])
            return model.io_stats(), model.config

    st, cfg = run(go())
    trace = read_trace(trace_path)
    nexts = [r.next for r in trace.records]
    if policy == "forecast":  # predictions are made (and recorded) for every layer but the last
        assert all((n is None) == (r.layer == cfg.n_layers - 1) for n, r in zip(nexts, trace.records))
    else:  # a policy that takes no hints: the model does not spend a router product per layer on them
        assert all(n is None for n in nexts)
    res = simulate(trace, st.n_slots, policy)
    assert (res.accesses, res.hits, res.misses, res.evictions) == (st.accesses, st.hits, st.misses, st.evictions)
    assert st.hits > 0 and st.evictions > 0
    for name in ("lru", "lfu", "lrfu", "forecast"):
        assert simulate(trace, st.n_slots, name).hits <= simulate(trace, st.n_slots, "belady").hits


def test_simulator_budget_gives_the_store_slot_count(tmp_path):
    """`clutor simulate --budget B` on a model's trace must model the cache Model.open(expert_cache=B)
    really gets: slots_for_budget documents "Slots a byte budget buys, as the store computes them"."""
    path = fixture_path("olmoe", "Q8_0")
    minimum, slot = _minimum(path)
    trace_path = tmp_path / "t.jsonl"
    budget = 12 * slot

    async def go():
        async with clutor.Model.open(path, io="threads", expert_cache=budget, trace=trace_path) as model:
            await model.logits(_prompt(4))
            return model.io_stats()

    st = run(go())
    header = read_trace(trace_path).header
    assert slots_for_budget(budget, header.expert_bytes) == st.n_slots, (
        f"simulator: {slots_for_budget(budget, header.expert_bytes)} slots of {header.expert_bytes} B; "
        f"store: {st.n_slots} slots of {st.slot_bytes} B + {st.arena_bytes // st.slot_bytes - st.n_slots} spare")


# -- 6. prefetch effect ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def six_layers(tmp_path_factory) -> Path:
    """A small 6-layer, 16-expert model (a few MB), so 'a cache of 2 layers' is a third of the experts."""
    spec = ModelSpec(name="six-layers", arch="qwen3moe", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                     n_expert=16, n_expert_used=2, n_ff_exp=256, vocab_size=512, n_ctx=512, rope_base=1e6,
                     eps=1e-6, qtype="Q8_0")
    return write_model(tmp_path_factory.mktemp("six") / "six.gguf", spec, seed=3)


def test_prefetch_raises_accuracy_on_the_same_greedy_run(six_layers):
    minimum, slot = _minimum(six_layers)
    cache = 2 * 16 * slot  # all experts of 2 layers

    async def go(prefetch: bool):
        async with clutor.Model.open(six_layers, io="threads", expert_cache=cache, prefetch=prefetch) as model:
            toks, stats = [], None
            async for o in model.generate("Once upon a time there was", max_tokens=24, temperature=0, ignore_eos=True):
                if o.token is not None:
                    toks.append(o.token)
                stats = o.stats or stats
            return toks, stats.io

    off_toks, off = run(go(False))
    on_toks, on = run(go(True))
    assert on_toks == off_toks
    assert off.prefetch_issued == 0 and off.prefetch_accuracy == off.hit_rate
    assert on.prefetch_issued > 0
    assert on.accesses == off.accesses
    assert on.prefetch_accuracy > off.prefetch_accuracy, (on, off)


def test_decode_prefetches_each_next_moe_layer_and_the_next_tokens_first(six_layers):
    """prefetch=True in decode: after each layer's take its misses are on their way and the next MoE layer's
    best-ranked predicted experts are queued; after the last layer's, the first layer's for the next token (read
    while the output and the sampling compute). A prefill step prefetches nothing."""
    from clutor.model.runner import PREFETCH_RANKS

    minimum, slot = _minimum(six_layers)

    async def go():
        async with clutor.Model.open(six_layers, io="threads", expert_cache=2 * 16 * slot, prefetch=True) as model:
            store = model.runner.experts
            calls: list[tuple[str, int]] = []
            take, prefetch = store.take, store.prefetch
            store.take = lambda layer, experts: (calls.append(("get", layer)), take(layer, experts))[1]
            asked: list[int] = []  # experts per prefetch call: one row's best-ranked predictions only
            store.prefetch = lambda layer, experts: (calls.append(("prefetch", layer)), asked.append(len(experts)),
                                                     prefetch(layer, experts))[2]
            async for _ in model.generate("Once upon a time there was", max_tokens=6, temperature=0, ignore_eos=True):
                pass
            return calls, model.config.n_layers, asked

    calls, n, asked = run(go())
    assert asked and all(1 <= k <= PREFETCH_RANKS for k in asked), asked
    prefill, decode = calls[:n], calls[n:]
    assert prefill == [("get", l) for l in range(n)], prefill
    # one get per layer per decode step; each followed by the prefetch of the next layer, the last by layer 0's
    steps = [decode[i : i + 2 * n] for i in range(0, len(decode), 2 * n)]
    assert len(steps) == 5 and all(len(s) == 2 * n for s in steps), decode
    for s in steps:
        assert s == [c for l in range(n) for c in (("get", l), ("prefetch", (l + 1) % n))], s


def test_streamed_layers_take_cached_experts_without_the_event_loop(six_layers, monkeypatch):
    """Streamed decode runs the whole layer loop on the compute thread: a layer's cached experts are pinned
    and computed there, the event loop not told at all; a layer with misses hands their reads to the loop
    once (one post: the loop owns the backend) and computes its cached experts meanwhile. A lone sequence's
    decode steps run one after another in one trip to the compute thread. The tokens are those of io="memory"."""
    import threading

    import clutor.model.runner as runner_mod
    from clutor.io.store import ExpertStore

    minimum, slot = _minimum(six_layers)
    prompt = "Once upon a time there was"

    async def reference():
        async with clutor.Model.open(six_layers, io="memory") as model:
            return [o.token async for o in model.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
                    if o.token is not None]

    async def go():
        async with clutor.Model.open(six_layers, io="threads", expert_cache=3 * 16 * slot, prefetch=False) as model:
            store = model.runner.experts
            loop_thread = threading.get_ident()
            trips = [0]
            posts = [0]  # calls handed to the loop from the compute thread
            layers: list[int] = []  # per take: its misses
            inner_compute, take, on_loop, submit = (runner_mod.compute, store.take, store._on_loop,
                                                    store._submit_demand)

            async def counting_compute(fn, *args, **kw):
                trips[0] += 1
                return await inner_compute(fn, *args, **kw)

            def counting_on_loop(fn, *args):
                if threading.get_ident() != loop_thread:
                    posts[0] += 1
                return on_loop(fn, *args)

            def counting_take(layer, experts):
                layers.append(0)
                return take(layer, experts)

            def counting_submit(loads):
                layers[-1] = len(loads)
                return submit(loads)

            per_step: list[tuple[int, list[int]]] = []  # (posts, misses per take) of each step run
            run_now = model.runner.run_now

            def counting_run_now(plan):
                posts[0] = 0
                layers.clear()
                try:
                    return run_now(plan)
                finally:
                    per_step.append((posts[0], list(layers)))

            monkeypatch.setattr(runner_mod, "compute", counting_compute)
            store.take, store._on_loop, store._submit_demand = counting_take, counting_on_loop, counting_submit
            model.runner.run_now = counting_run_now
            toks = [o.token async for o in model.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
                    if o.token is not None]
            return toks, per_step, trips[0], model.config.n_layers, store

    want = run(reference())
    toks, per_step, trips, n, store = run(go())
    assert toks == want
    decode = per_step[1:]  # the first step is the prefill
    assert len(decode) == 7
    for posted, misses in decode:
        assert len(misses) == n, misses
        assert posted == sum(m > 0 for m in misses), (posted, misses)  # one post per layer with misses, else none
    all_cached = sum(m == 0 for _, misses in decode for m in misses)
    assert 0 < all_cached < 7 * n  # both kinds of layer occurred
    assert trips == 2, trips  # the prefill, then the lone sequence's decode loop
    assert all(store.cache.pins(s) == 0 for s in range(store.n_slots))
    store.check()


def test_prefetch_picks_by_router_weight_where_weights_are_probabilities(monkeypatch):
    """olmoe's router weights are its softmax over every expert (top-k not renormalised): the experts
    decode prefetches for the next MoE layer are those of its router (on the current residual) given
    weight >= PREFETCH_MIN_WEIGHT, best first, however many that is (none, or more than two); a
    renormalised router (qwen3moe) keeps the PREFETCH_RANKS best ranks."""
    from clutor.model.runner import PREFETCH_MIN_WEIGHT, PREFETCH_RANKS

    async def go(arch: str):
        async with clutor.Model.open(fixture_path(arch, "Q8_0"), io="memory") as model:
            r = model.runner
            rng = np.random.default_rng(5)
            out = []
            for trial in range(40):
                x = rng.standard_normal((1, model.config.n_embd)).astype(np.float32) * (0.5 + trial / 10)
                l = model.config.moe_layers[-1]
                _, pf = r._predict(l, x)
                lw = r._w.layers[l]
                sel, w = r.arch.route(lw, r.arch.ffn_input(lw, x))
                out.append((pf, sel[0].tolist(), w[0].tolist()))
            return out

    sizes = set()
    for pf, sel, w in run(go("olmoe")):
        assert pf == [e for e, q in zip(sel, w) if q >= PREFETCH_MIN_WEIGHT], (pf, sel, w)
        sizes.add(len(pf))
    assert len(sizes) > 1, sizes  # the count follows the weights, not a fixed rank budget
    for pf, sel, w in run(go("qwen3moe")):
        assert pf == sel[:PREFETCH_RANKS], (pf, sel, w)


def test_default_prefetch_only_with_a_cache_of_more_than_a_tokens_experts(six_layers):
    """prefetch=None, one sequence: the six-layer model needs 6 x 2 = 12 experts a token; a cache of 12
    buffers (one token's experts) prefetches nothing, one of 32 (PREFETCH_MIN_TOKENS = 1.5 tokens and
    more) prefetches every decode step; prefetch=True prefetches in the small cache too."""
    from clutor.model.runner import PREFETCH_MIN_TOKENS

    minimum, slot = _minimum(six_layers)

    async def go(buffers: int, prefetch):
        async with clutor.Model.open(six_layers, io="threads", expert_cache=buffers * slot, prefetch=prefetch) as model:
            cfg = model.config
            per_token = len(cfg.moe_layers) * cfg.n_expert_used
            async for _ in model.generate("Once upon a time there was", max_tokens=6, temperature=0, ignore_eos=True):
                pass
            return model.runner.experts.capacity / per_token, model.io_stats().prefetch_issued

    small, issued_small = run(go(12, None))
    large, issued_large = run(go(32, None))
    forced, issued_forced = run(go(12, True))
    assert small < PREFETCH_MIN_TOKENS <= large, (small, large)
    assert issued_small == 0 and issued_large > 0 and issued_forced > 0, (issued_small, issued_large, issued_forced)


def test_default_prefetch_reads_ahead_in_batched_decode_on_an_idle_disk_only(six_layers):
    """prefetch=None, four sequences batched in a cache of 2 layers' experts: every decode step queues the
    next MoE layer's experts its rows' routers vote for, those reads serve demands (staging hits), and
    the store hands a prefetch read to the backend only while no demand read is in flight, so a demand
    read shares the disk with at most PREFETCH_DEPTH prefetched experts already started, never with one
    submitted after it. The tokens are io="memory"'s."""
    from clutor.io import store as store_mod

    minimum, slot = _minimum(six_layers)
    prompts = [f"Story {i}: once upon a time" for i in range(4)]

    async def tokens(model):
        async def one(p):
            return [o.token async for o in model.generate(p, max_tokens=10, temperature=0, ignore_eos=True)
                    if o.token is not None]
        return await asyncio.gather(*(one(p) for p in prompts))

    async def reference():
        async with clutor.Model.open(six_layers, io="memory", max_sequences=4) as model:
            return await tokens(model)

    async def go():
        async with clutor.Model.open(six_layers, io="threads", expert_cache=2 * 16 * slot, max_sequences=4) as model:
            runner, store = model.runner, model.runner.experts
            seqs = [0]
            issued_in: dict[int, int] = {}  # sequences in a step -> experts prefetch() was asked for
            submits: list[tuple[bool, int, int]] = []  # (demand, demand loads in flight, prefetches in flight)
            real_run, real_prefetch, real_submit = runner.run, store.prefetch, store._submit

            async def run_step(plan):
                seqs[0] = len(plan.segments) if plan.decode else 0
                return await real_run(plan)

            def prefetch(layer, experts):
                issued_in[seqs[0]] = issued_in.get(seqs[0], 0) + len(experts)
                return real_prefetch(layer, experts)

            def submit(loads, demand):
                in_flight = len(store._pf_submitted)
                submits.append((demand, store._outstanding - in_flight, in_flight))
                return real_submit(loads, demand)

            runner.run, store.prefetch, store._submit = run_step, prefetch, submit
            toks = await tokens(model)
            return toks, issued_in, submits, model.io_stats()

    want = run(reference())
    toks, issued_in, submits, st = run(go())
    assert toks == want
    assert issued_in.get(4, 0) > 0, issued_in  # batched decode steps read ahead
    assert st.staging_hits > 0 and st.bytes_prefetch > 0, st
    prefetch_submits = [s for s in submits if not s[0]]
    assert prefetch_submits and all(busy == 0 for _, busy, _ in prefetch_submits), prefetch_submits
    assert all(pf <= store_mod.PREFETCH_DEPTH for demand, _, pf in submits if demand), submits


def test_every_buffer_but_one_spare_caches_and_decode_never_reads_past_the_cache(six_layers):
    """A quarter of the six-layer model's 96 experts is 24 buffers: 23 cache slots and the one spare
    for bypass reads (store._SPARES). A step pins one layer's experts at a time and may steal what
    prefetch staged, so neither a prefetching one-sequence decode nor four sequences batched ever
    needs the spare: every miss is read into a cache slot."""
    minimum, slot = _minimum(six_layers)

    async def go(n_seq: int):
        async with clutor.Model.open(six_layers, io="threads", expert_cache=24 * slot, prefetch=True,
                                     max_sequences=n_seq) as model:
            async def one(i):
                async for _ in model.generate(f"Story {i}: once upon a time", max_tokens=12, temperature=0,
                                              ignore_eos=True):
                    pass

            await asyncio.gather(*(one(i) for i in range(n_seq)))
            return model.io_stats()

    for n_seq in (1, 4):
        st = run(go(n_seq))
        assert (st.n_slots, st.arena_bytes // st.slot_bytes) == (23, 24), st
        assert st.misses > st.n_slots and st.evictions > 0, st  # the cache was full and turned over
        assert st.bypass_reads == 0, st
        if n_seq == 1:
            assert st.prefetch_issued > 0, st

"""The in-memory experts' tables (clutor.model.resident): a layer's routed sum with the general path's bits.

Each case computes one MoE layer's routed experts for R rows both ways on the same inputs: the resident
table (what Runner._run_now takes with io="memory") and the general path (Runner._experts_out, then
_moe_add, what every streamed step takes), and asserts the layer outputs are the same bits.
"""
from __future__ import annotations

import numpy as np
import pytest

from clutor.errors import ClosedError, ClutorError
from clutor.model.layers import silu
from clutor.model.runner import _by_votes

from conftest import fixture_path, run

# (arch, type): every routed-expert shape the table takes (gated SwiGLU; Llama 4's weight before the
# FFN; Gemma 4's per-expert scale and GELU; Nemotron-H's ungated experts; K-, i- and legacy quants)
CASES = [("olmoe", "Q8_0"), ("olmoe", "Q4_K_M"), ("olmoe", "IQ2_XXS"), ("qwen3moe", "Q6_K"), ("mixtral", "Q8_0"),
         ("llama4", "Q4_K_M"), ("gemma4", "Q4_K_M"), ("nemotron_h_moe", "Q4_K_M"), ("deepseek2", "Q8_0"),
         ("olmoe", "F16")]


class _Layer:
    """What Runner._experts_out keeps of a step between one layer's expert groups: the slots being filled."""
    slot_outputs = None


def _both(model, R: int, seed: int = 0, scale: float = 1.0):
    """(table, the table's layer output, the general path's) for the first MoE layer, R random rows."""
    run_ = model.runner
    cfg = run_.config
    l = cfg.moe_layers[0]
    lw = run_._w.layers[l]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, cfg.n_embd)).astype(np.float32)  # [R, D]
    h = (run_.arch.ffn_input(lw, x) * np.float32(scale)).astype(np.float32)  # [R, D]
    sel, w = run_.arch.route(lw, run_.arch.router_input(lw, x, h))  # [R, K]
    table = run_._resident.table(l, run_._moe_index[l])
    wanted = _by_votes(sel)
    step = _Layer()
    out = run_._experts_out(l, h, sel, w, run_.experts.views_now(run_._moe_index[l], wanted), step)
    general = run_._moe_add(l, x, h, [out[e] for e in wanted], step)
    fast = None if table is None else run_._moe_add(l, x, h, table.sum(h, sel, w), step)
    return table, fast, general


def _open(arch, qtype, activations):
    import clutor

    return clutor.Model.open(fixture_path(arch, qtype), io="memory", activations=activations, prefix_cache=0)


@pytest.mark.parametrize("activations", ["q8", "f32"])
@pytest.mark.parametrize("arch,qtype", CASES)
def test_table_equals_general_path(arch, qtype, activations):
    async def go():
        async with _open(arch, qtype, activations) as model:
            for R in (1, 2, 3, 8, 33):
                table, fast, general = _both(model, R, seed=R)
                if qtype == "F16" and model.kernels.activations != "f32":
                    assert table is None  # F16 in q8 mode: rounded activations, the general path's
                    return
                assert table is not None, (arch, qtype)
                assert fast.dtype == general.dtype == np.float32
                np.testing.assert_array_equal(fast.view(np.uint32), general.view(np.uint32), err_msg=f"R={R}")

    run(go())


def test_gate_past_exp_range_equals_general_path(monkeypatch):
    """Gates below -88 (numpy's exp(-gate) may overflow to inf): silu's own path, the same bits."""
    import clutor.model.resident as resident

    fallbacks = []

    def counted(x):
        fallbacks.append(float(x.min()))
        return silu(x)

    monkeypatch.setattr(resident, "silu", counted)

    async def go():
        async with _open("olmoe", "Q8_0", "q8") as model:
            table, fast, general = _both(model, 4, scale=200.0)
            assert fallbacks and min(fallbacks) < -88, fallbacks  # the case happened
            assert np.isfinite(general).all()
            np.testing.assert_array_equal(fast.view(np.uint32), general.view(np.uint32))

    run(go())


def test_biased_experts_take_the_general_path():
    async def go():
        async with _open("gptoss", "Q8_0", "q8") as model:
            table, fast, general = _both(model, 2)
            assert table is None and fast is None

    run(go())


def test_expert_id_out_of_range_is_refused():
    async def go():
        async with _open("olmoe", "Q8_0", "q8") as model:
            r = model.runner
            l = r.config.moe_layers[0]
            table = r._resident.table(l, r._moe_index[l])
            h = np.ones((1, r.config.n_embd), np.float32)
            K = r.config.n_expert_used
            w = np.full((1, K), 0.1, np.float32)
            for bad in (-1, r.config.n_expert):
                sel = np.arange(K, dtype=np.int64).reshape(1, K)
                sel[0, -1] = bad
                with pytest.raises(ClutorError, match="outside"):
                    table.sum(h, sel, w)
            return table, h, w

    table, h, w = run(go())
    # the source is closed now: the table refuses rather than touch pages of a closed mapping
    with pytest.raises(ClosedError):
        table.sum(h, np.zeros((1, w.shape[1]), np.int64), w)


def test_generation_takes_the_table():
    """A generation's decode steps go through the tables (each layer's one table), not the general path."""
    async def go():
        async with _open("olmoe", "Q8_0", "q8") as model:
            r = model.runner
            calls = {"general": 0}
            general = r._experts_out

            def counted(*a):
                calls["general"] += 1
                return general(*a)

            r._experts_out = counted
            toks = [o.token for o in [o async for o in model.generate([1, 2, 3], max_tokens=4, temperature=0.0)]
                    if o.token is not None]
            assert toks and calls["general"] == 0
            assert all(r._resident._tables[l] is not None for l in r.config.moe_layers)

    run(go())


def _streamed_run(path, **opts):
    """(prefill logits [T, V] of a 12-token prompt, a batched step's logits [2, V] of two sequences'
    next tokens, compiled groups, general-path calls, steps, the row counts compiled groups saw) of one
    open of path."""
    import clutor

    async def go():
        async with clutor.Model.open(path, prefix_cache=0, **opts) as model:
            r = model.runner
            calls = {"general": 0}
            general = r._experts_general

            def counted(*a):
                calls["general"] += 1
                return general(*a)

            r._experts_general = counted
            rows = set()  # each compiled group's step rows
            if r._streamed is not None:
                group = r._streamed.group

                def seen(l, h, sel, *a):
                    rows.add(len(sel))
                    return group(l, h, sel, *a)

                r._streamed.group = seen
            prompt = [(7 * i + 3) % 200 + 1 for i in range(12)]
            full = await model.logits(prompt)
            a, b = model.new_sequence(), model.new_sequence()
            await model.forward(a, prompt[:5])
            await model.forward(b, prompt[5:])
            la, lb = await model.forward_batch([(a, [prompt[5]]), (b, [prompt[0]])])  # one decode step, 2 rows
            steps = np.concatenate([la, lb])
            groups = r._streamed.groups if r._streamed is not None else 0
            return full, steps, groups, calls["general"], r.steps, rows

    return run(go())


@pytest.mark.parametrize("activations", ["q8", "f32"])
@pytest.mark.parametrize("path", ["real", ("olmoe", "Q4_K_M")])
def test_streamed_groups_take_the_compiled_path_with_the_memory_bits(path, activations):
    """A streamed source's expert groups (cache slots) go through the compiled path (StreamedExperts,
    not the general path) and give io="memory"'s logits bit for bit, in a prefill and in a batched
    decode step of two sequences, with a cache small enough that layers arrive in several groups.
    (f32 activations: q8 ones round the residual into int8 blocks before every product, which can
    hide a layer sum's last bits from the logits.)"""
    from conftest import shared_data

    path = shared_data("models/real-olmoe-q8_0.gguf") if path == "real" else fixture_path(*path)
    ref_full, ref_steps, *_ = _streamed_run(path, io="memory", activations=activations)
    full, steps, groups, general, n_steps, rows = _streamed_run(path, io="threads", expert_cache="25%", prefetch=True,
                                                                activations=activations)
    assert general == 0 and groups > n_steps, (groups, general, n_steps)  # several groups a step, none general
    assert {12, 2} <= rows, rows  # the prefill and the batched decode step (both sequences in one step)
    np.testing.assert_array_equal(full.view(np.uint32), ref_full.view(np.uint32))
    np.testing.assert_array_equal(steps.view(np.uint32), ref_steps.view(np.uint32))


def _inputs(model, R: int, seed: int):
    """(l, x [R, D], h [R, D], sel [R, K], w [R, K]) of the first MoE layer for R random rows."""
    r = model.runner
    l = r.config.moe_layers[0]
    lw = r._w.layers[l]
    x = np.random.default_rng(seed).standard_normal((R, r.config.n_embd)).astype(np.float32)  # [R, D]
    h = r.arch.ffn_input(lw, x)  # [R, D]
    sel, w = r.arch.route(lw, r.arch.router_input(lw, x, h))  # [R, K]
    return l, x, h, sel, w


@pytest.mark.parametrize("activations", ["q8", "f32"])
@pytest.mark.parametrize("arch,qtype", CASES + [("gptoss", "Q8_0")])
def test_streamed_groups_equal_the_table_and_the_general_path(arch, qtype, activations):
    """One MoE layer of a streamed source (cache slots), its experts in three groups: the compiled path
    (Runner._experts_out then _moe_add) is taken exactly where io="memory"'s table is (a count of
    groups), and gives the general path's bits and the table's; one group left to the general path
    (put into the same slots) changes no bit either."""
    import clutor

    async def go():
        path = fixture_path(arch, qtype)
        async with _open(arch, qtype, activations) as mem, \
                clutor.Model.open(path, io="threads", expert_cache="100%", prefetch=False, activations=activations,
                                  prefix_cache=0) as st:
            r = st.runner
            for R in (1, 2, 3, 8, 33):
                table, fast, _ = _both(mem, R, seed=R)
                l, x, h, sel, w = _inputs(st, R, seed=R)
                wanted = _by_votes(sel)
                thirds = [wanted[i::3] for i in range(3) if wanted[i::3]]  # each group other experts
                batch = await r.experts.get(r._moe_index[l], wanted)
                try:
                    views = dict(zip(wanted, batch.views))
                    before = r._streamed.groups
                    ys, general, mixed = {}, {}, {}
                    step = _Layer()
                    for g in thirds:
                        ys.update(r._experts_out(l, h, sel, w, [views[e] for e in g], step))
                    compiled = r._streamed.groups - before
                    out = r._moe_add(l, x, h, [ys[e] for e in wanted], step)
                    step = _Layer()
                    for i, g in enumerate(thirds):
                        general.update(r._experts_general(l, h, sel, w, [views[e] for e in g]))
                        if i == 0:  # the first group general
                            mixed.update(r._experts_general(l, h, sel, w, [views[e] for e in g]))
                        else:
                            mixed.update(r._experts_out(l, h, sel, w, [views[e] for e in g], step))
                    ref = r._moe_add(l, x, h, [general[e] for e in wanted], _Layer())
                    mix = r._moe_add(l, x, h, [mixed[e] for e in wanted], step)
                finally:
                    batch.release()
                assert compiled == (len(thirds) if table is not None and table.fits(sel, w) else 0), (R, compiled)
                assert out.dtype == np.float32
                np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32), err_msg=f"R={R}")
                np.testing.assert_array_equal(mix.view(np.uint32), ref.view(np.uint32), err_msg=f"R={R}")
                if fast is not None:
                    np.testing.assert_array_equal(out.view(np.uint32), fast.view(np.uint32), err_msg=f"R={R}")

    run(go())


def test_streamed_group_refuses_bad_ids():
    """A router id outside the layer's experts, or a group naming an expert twice: a ClutorError
    before any kernel reads an address."""
    import clutor

    async def go():
        async with clutor.Model.open(fixture_path("olmoe", "Q8_0"), io="threads", expert_cache="100%",
                                     prefetch=False, prefix_cache=0) as model:
            r = model.runner
            l, x, h, sel, w = _inputs(model, 1, seed=0)
            batch = await r.experts.get(r._moe_index[l], [int(sel[0, 0])])
            try:
                v = batch.views[0]
                bad = sel.copy()
                bad[0, -1] = r.config.n_expert
                with pytest.raises(ClutorError, match="outside"):
                    r._streamed.group(l, h, bad, w, [v], None)
                with pytest.raises(ClutorError, match="repeated"):
                    r._streamed.group(l, h, sel, w, [v, v], None)
                assert r._streamed.groups == 0
            finally:
                batch.release()

    run(go())

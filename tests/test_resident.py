"""The in-memory experts' tables (clutor.model.resident): a layer's routed sum with the general path's bits.

Each case computes one MoE layer's routed experts for R rows both ways on the same inputs: the resident
table (what Runner._run_now takes with io="memory") and the general path (Runner._experts_out, then
_moe_add, what every streamed step takes), and asserts the layer outputs are the same bits.
"""
from __future__ import annotations

import asyncio

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
    out = run_._experts_out(l, h, sel, w, run_.experts.views_now(run_._moe_index[l], wanted))
    general = run_._moe_add(l, x, h, [out[e] for e in wanted])
    fast = None if table is None else run_._moe_add(l, x, h, table.sum(h, sel, w))
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
    next tokens, compiled groups, general-path calls) of one open of path."""
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
            prompt = [(7 * i + 3) % 200 + 1 for i in range(12)]
            full = await model.logits(prompt)
            a, b = model.new_sequence(), model.new_sequence()
            await model.forward(a, prompt[:5])
            await model.forward(b, prompt[5:])
            la, lb = await asyncio.gather(model.forward(a, [prompt[5]]), model.forward(b, [prompt[0]]))
            steps = np.stack([la[-1], lb[-1]])
            groups = r._streamed.groups if r._streamed is not None else 0
            return full, steps, groups, calls["general"], r.steps

    return run(go())


@pytest.mark.parametrize("path", ["real", ("olmoe", "Q4_K_M")])
def test_streamed_groups_take_the_compiled_path_with_the_memory_bits(path):
    """A streamed source's expert groups (cache slots) go through the compiled path (StreamedExperts,
    not the general path) and give io="memory"'s logits bit for bit, in a prefill and in a batched
    decode step of two sequences, with a cache small enough that layers arrive in several groups."""
    from conftest import shared_data

    path = shared_data("models/real-olmoe-q8_0.gguf") if path == "real" else fixture_path(*path)
    ref_full, ref_steps, _, _, _ = _streamed_run(path, io="memory")
    full, steps, groups, general, n_steps = _streamed_run(path, io="threads", expert_cache="25%", prefetch=True)
    assert general == 0 and groups > n_steps, (groups, general, n_steps)  # several groups a step, none general
    np.testing.assert_array_equal(full.view(np.uint32), ref_full.view(np.uint32))
    np.testing.assert_array_equal(steps.view(np.uint32), ref_steps.view(np.uint32))

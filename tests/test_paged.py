"""The rotary attention over KV pages (clutor.model.kernels.paged, Step.attend_rotary) against numpy's
way of the same layer (rotate, write, gather the pages, attend): the pages it writes hold the same bits,
its outputs the same values, and a row's output the same bits whatever else is in the step."""
from __future__ import annotations

import numpy as np
import pytest

from clutor.model.kernels.paged import float_to_half, half_to_float
from clutor.model.kv import PAGE, KVPool
from clutor.model.layers import Rope
from clutor.model.plan import StepPlan, Want
from clutor.model.state import FullKV
from clutor.model.step import Step

H, HKV, DK, DV = 4, 2, 32, 32


def test_half_conversions_are_numpys():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = half_to_float(bits)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all()
    finite = want[np.isfinite(want)].astype(np.float64)
    finite.sort()
    mid = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # ties: round to even
    rng = np.random.default_rng(0)
    x = np.concatenate([want[np.isfinite(want)], mid, np.nextafter(mid, np.float32(np.inf)),
                        np.nextafter(mid, np.float32(-np.inf)),
                        *(rng.standard_normal(1 << 16).astype(np.float32) * s for s in (1e-7, 1e-4, 1.0, 3e4)),
                        np.array([65519.99, 65520.0, 65536.0, 1e30, np.inf, -np.inf, -0.0], np.float32)])
    with np.errstate(over="ignore"):
        assert np.array_equal(float_to_half(x), x.astype(np.float16).view(np.uint16))


def _steps(kv_type: str, both: list[tuple[int, int]], seed: int = 0):
    """Two pools holding the same sequences; for each (prompt length, new tokens) of ``both`` the
    sequences' prompts are written through one path or the other, then one step appends new tokens."""
    rng = np.random.default_rng(seed)
    pools = [KVPool([FullKV(HKV, DK, DV)] * 2, n_ctx=256, budget=1 << 22, kv_type=kv_type) for _ in range(2)]
    seqs = [[p.sequence() for _ in both] for p in pools]
    rope = Rope(DK, 10000.0, 256, style="neox")
    data = []
    for n0, n1 in both:
        data.append([(rng.standard_normal((n, H, DK)).astype(np.float32), rng.standard_normal((n, HKV, DK)).astype(np.float32),
                      rng.standard_normal((n, HKV, DV)).astype(np.float32)) for n in (n0, n1)])
    return pools, seqs, rope, data


def _run(pool, seqs, rope, parts, fused: bool, idx):
    """One step of the sequences idx with their parts; -> the attention output [R, H * DV]."""
    items = [(seqs[i], np.arange(len(parts[i][0])), Want.LAST) for i in idx]
    for seq, ids, _ in items:
        pool.done(pool.reserve(seq, seq.n + len(ids)))
    plan = StepPlan.build(items)
    step = Step(plan, pool)
    step.prepare()
    q, k, v = (np.concatenate([parts[i][j] for i in idx]) for j in range(3))
    scale = 1 / np.sqrt(DK)
    out = step.attend_rotary(1, rope, q, k, v, scale) if fused else \
        step.attend(1, step.rope(rope, q), step.rope(rope, k), v, scale)
    step.commit()
    return out


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_rotary_attention_over_pages_matches_numpys_way(kv_type):
    both = [(37, 1), (5, 1), (PAGE, 3)]
    pools, seqs, rope, data = _steps(kv_type, both)
    for fused, pool, ss in ((True, pools[0], seqs[0]), (False, pools[1], seqs[1])):
        outs = [_run(pool, ss, rope, [d[0] for d in data], fused, [i]) for i in range(len(both))]  # prefill each alone
        outs.append(_run(pool, ss, rope, [d[1] for d in data], fused, range(len(both))))  # then one step of all
        if fused:
            fused_outs = outs
        else:
            ref_outs = outs
    g0, g1 = pools[0].groups[0], pools[1].groups[0]
    assert np.array_equal(g0.data.view(np.uint8), g1.data.view(np.uint8))  # the same keys and values written
    if kv_type == "q8_0":
        assert np.array_equal(g0.scales.view(np.uint16), g1.scales.view(np.uint16))
    for a, b in zip(fused_outs, ref_outs):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_a_rows_attention_has_its_solo_bits_in_any_step():
    both = [(40, 1), (23, 1)]
    pools, seqs, rope, data = _steps("f16", both, seed=1)
    for pool, ss in zip(pools, seqs):
        for i in range(2):
            _run(pool, ss, rope, [d[0] for d in data], True, [i])
    together = _run(pools[0], seqs[0], rope, [d[1] for d in data], True, [0, 1])
    alone = [_run(pools[1], seqs[1], rope, [d[1] for d in data], True, [i]) for i in (1, 0)]
    assert np.array_equal(together[0], alone[1][0]) and np.array_equal(together[1], alone[0][0])

"""A step's routed experts as driver job arrays, and their weighted sum, compiled.

    m = route_jobs(sel, w, h, before, addr, parts, xg, wf, pair, starts, jobs_gu, jobs_dn)
    m, n = route_group(sel, w, h, before, ids, addr_g, parts, pos, xg, wf, pair, jobs_gu, jobs_dn)  # some experts
    big = negated_gate(gu, e); np.exp(e, out=e); swiglu_from_exp(gu, e, a)   # the default SwiGLU, numpy's exp
    slot_sum(y, sel, pair, wf, scale, weighted, out)
    put_slots(y, sel, pair, wf, scale, weighted, n, slots); sum_slots(slots, out)   # a group at a time

What the runner's general path (Runner._experts_out, _moe_add) computes with numpy and a list of Job
tuples per layer, for experts whose weights sit at fixed addresses (a table per layer, built once):
the step's (row, top-k slot) pairs grouped by expert, each group one job of the int8 / float driver
(drivers.py) for gate | up and one for down; then each row's experts scaled and summed in its router's
slot order. A streamed step's experts arrive in groups (cache slots, other ones each step): route_group
makes one group's jobs from its own addresses, put_slots writes its pairs' scaled, weighted outputs into
the step's slots [S, D] by flat index row * K + slot, and sum_slots sums them as slot_sum does.
Shapes: R rows, K slots, S = R * K pairs, E experts, D = n_embd, P parts (gate, up, down, or up, down
ungated).

Bits: the drivers give a token the same sum wherever it sits in a job (drivers._idot_rows), so the
grouping does not move them; the scaling and the sum are float32 multiplies and adds in numpy's order
(no fastmath: a reassociated (y * s) * w or sum would change the last bits).
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["route_jobs", "route_group", "slot_sum", "put_slots", "sum_slots", "negated_gate", "swiglu_from_exp", "EXP_SAFE", "PART_QT", "PART_RB", "PART_ROWS", "PART_COL"]

_opts = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")

# the columns of route_jobs' parts [P, 4]: each part's type, bytes per row, rows (output columns), first
# output column
PART_QT, PART_RB, PART_ROWS, PART_COL = range(4)


@njit(**_opts)
def _put_jobs(jobs_gu, jobs_dn, m, addr, parts, t0, n):
    """The m-th expert's job rows (drivers.py's columns): one per gate | up part into jobs_gu, its down
    part into jobs_dn; addr int64 [P] its parts' addresses, its pairs t0 .. t0 + n - 1 (the job's rows)."""
    P = addr.shape[0]
    for p in range(P - 1):
        j = m * (P - 1) + p
        jobs_gu[j, 0] = addr[p]
        jobs_gu[j, 1] = parts[p, PART_QT]
        jobs_gu[j, 2] = parts[p, PART_RB]
        jobs_gu[j, 3] = parts[p, PART_ROWS]
        jobs_gu[j, 4] = t0
        jobs_gu[j, 5] = n
        jobs_gu[j, 6] = parts[p, PART_COL]
    jobs_dn[m, 0] = addr[P - 1]
    jobs_dn[m, 1] = parts[P - 1, PART_QT]
    jobs_dn[m, 2] = parts[P - 1, PART_RB]
    jobs_dn[m, 3] = parts[P - 1, PART_ROWS]
    jobs_dn[m, 4] = t0
    jobs_dn[m, 5] = n
    jobs_dn[m, 6] = 0


@njit(**_opts)
def route_jobs(sel, w, h, before, addr, parts, xg, wf, pair, starts, jobs_gu, jobs_dn):
    """sel int64 [R, K], w f32 [R, K], h f32 [R, D]; addr int64 [E, P] each expert's part addresses
    (the last part is down, the others gate | up into one output); parts int64 [P, 4] -> fills
    xg f32 [S, D] (the pairs' rows of h, times their weight when `before`), wf f32 [S] their weights,
    pair int64 [S] their flat index row * K + slot (grouped by expert id ascending, row-major within),
    starts int64 [E + 1] (scratch), and the drivers' job rows (drivers.py's columns): jobs_gu
    [m * (P - 1), 7], jobs_dn [m, 7] for the m distinct experts. Returns m, or -1 when an id of sel
    lies outside 0 .. E - 1 (nothing then may be launched)."""
    R, K = sel.shape
    E, P = addr.shape
    D = h.shape[1]
    starts[:] = 0
    for r in range(R):
        for k in range(K):
            e = sel[r, k]
            if e < 0 or e >= E:
                return -1
            starts[e + 1] += 1
    for e in range(E):
        starts[e + 1] += starts[e]  # starts[e]: expert e's first pair
    m = 0
    for e in range(E):
        t0 = starts[e]
        n = starts[e + 1] - t0
        if n == 0:
            continue
        _put_jobs(jobs_gu, jobs_dn, m, addr[e], parts, t0, n)
        m += 1
    for r in range(R):  # each pair to its expert's next place (starts[e] ends as expert e + 1's first)
        for k in range(K):
            e = sel[r, k]
            s = starts[e]
            starts[e] = s + 1
            pair[s] = r * K + k
            wf[s] = w[r, k]
            if before:  # Llama 4: the weight scales the expert's input (xg * wf, as numpy rounds it)
                for d in range(D):
                    xg[s, d] = h[r, d] * w[r, k]
            else:
                xg[s, :] = h[r, :]
    return m


@njit(**_opts)
def slot_sum(y, sel, pair, wf, scale, weighted, out):
    """y f32 [S, D] the pairs' down products (route_jobs' order) -> out f32 [R, D]: each row's slots
    in router order, y * scale[expert] (scale f32 [E], or empty for none) then * its weight when
    `weighted`, summed as out = slot 0, then += slot 1, ... (the general path's order)."""
    R, K = sel.shape
    D = y.shape[1]
    inv = np.empty(R * K, np.int64)  # flat index -> pair
    for s in range(R * K):
        inv[pair[s]] = s
    scaled = scale.shape[0] > 0
    for r in range(R):
        for k in range(K):
            s = inv[r * K + k]
            c = scale[sel[r, k]] if scaled else np.float32(1.0)
            for d in range(D):
                v = y[s, d]
                if scaled:
                    v = v * c
                if weighted:
                    v = v * wf[s]
                if k == 0:
                    out[r, d] = v
                else:
                    out[r, d] += v


@njit(**_opts)
def route_group(sel, w, h, before, ids, addr, parts, pos, xg, wf, pair, jobs_gu, jobs_dn):
    """route_jobs for a group of the step's experts: ids int64 [G] (distinct), addr int64 [G, P] their
    parts' addresses; pos int64 [E] scratch (E: the layer's experts). Fills xg, wf, pair for the pairs
    routed to the group (grouped in ids' order, row-major within) and one job per expert and part, as
    route_jobs does. Returns (m, n): the group's experts some row chose, and its pairs; (-1, 0) when an
    id of sel or ids lies outside 0 .. E - 1 or ids repeats one (nothing then may be launched)."""
    R, K = sel.shape
    G, P = addr.shape
    E = pos.shape[0]
    D = h.shape[1]
    pos[:] = -1
    for g in range(G):
        e = ids[g]
        if e < 0 or e >= E or pos[e] >= 0:
            return -1, 0
        pos[e] = g
    starts = np.zeros(G + 1, np.int64)
    for r in range(R):
        for k in range(K):
            e = sel[r, k]
            if e < 0 or e >= E:
                return -1, 0
            g = pos[e]
            if g >= 0:
                starts[g + 1] += 1
    for g in range(G):
        starts[g + 1] += starts[g]  # starts[g]: group expert g's first pair
    m = 0
    for g in range(G):
        t0 = starts[g]
        n = starts[g + 1] - t0
        if n == 0:
            continue
        _put_jobs(jobs_gu, jobs_dn, m, addr[g], parts, t0, n)
        m += 1
    n_pairs = starts[G]
    for r in range(R):
        for k in range(K):
            g = pos[sel[r, k]]
            if g < 0:
                continue
            s = starts[g]
            starts[g] = s + 1
            pair[s] = r * K + k
            wf[s] = w[r, k]
            if before:
                for d in range(D):
                    xg[s, d] = h[r, d] * w[r, k]
            else:
                xg[s, :] = h[r, :]
    return m, n_pairs


@njit(**_opts)
def put_slots(y, sel, pair, wf, scale, weighted, n, slots):
    """y f32 [>= n, D] a group's down products (route_group's order) -> slots f32 [R * K, D]: pair s's
    row pair[s], y * scale[expert] then * its weight when `weighted` (slot_sum's products)."""
    K = sel.shape[1]
    D = y.shape[1]
    scaled = scale.shape[0] > 0
    for s in range(n):
        f = pair[s]
        c = scale[sel[f // K, f % K]] if scaled else np.float32(1.0)
        for d in range(D):
            v = y[s, d]
            if scaled:
                v = v * c
            if weighted:
                v = v * wf[s]
            slots[f, d] = v


@njit(**_opts)
def sum_slots(slots, out):
    """slots f32 [R * K, D] each (row, slot)'s weighted output -> out f32 [R, D], each row's slots summed
    as slot_sum sums them (out = slot 0, then += slot 1, ...)."""
    R, D = out.shape
    K = slots.shape[0] // R
    for r in range(R):
        for d in range(D):
            out[r, d] = slots[r * K, d]
        for k in range(1, K):
            for d in range(D):
                out[r, d] += slots[r * K + k, d]


# exp(-g) is finite below this (float32 exp overflows past ln(FLT_MAX) = 88.72...): a gate under -EXP_SAFE
# is where numpy's exp may overflow (and warn, unless inside np.errstate, which costs more than the exp)
EXP_SAFE = np.float32(88.0)


@njit(**_opts)
def negated_gate(gu, e):
    """gu f32 [S, 2F] gate | up -> e f32 [S, F] = -gate; returns whether some -gate exceeds EXP_SAFE."""
    S, F = e.shape
    big = False
    for s in range(S):
        for f in range(F):
            v = -gu[s, f]
            e[s, f] = v
            big |= v > EXP_SAFE
    return big


@njit(**_opts)
def swiglu_from_exp(gu, e, out):
    """gu f32 [S, 2F] gate | up, e f32 [S, F] = exp(-gate) (numpy's, which compiled code would not
    reproduce: its SIMD expf differs from libm's) -> out f32 [S, F] = gate / (1 + e) * up, in
    float32 as layers.silu(gate) * up rounds it."""
    S, F = out.shape
    for s in range(S):
        for f in range(F):
            out[s, f] = gu[s, f] / (np.float32(1.0) + e[s, f]) * gu[s, F + f]

"""Nemotron-3 Nano (`nemotron_h_moe`): Mamba-2, attention and MoE layers, each layer one of the three.

- Which kind layer i is comes from per-layer arrays only: `attention.head_count_kv[i]` > 0 is an
  attention layer, `feed_forward_length[i]` > 0 a MoE layer, neither a Mamba-2 layer. Every layer
  is x + mixer(rms_norm(x) * `attn_norm`), with no second norm.
- Mamba-2: `ssm_in` -> [z | xBC | dt] (z and x are `ssm.inner_size` wide, B and C `ssm.group_count`
  x `ssm.state_size` each, dt one per head, `ssm.time_step_rank` heads); a causal depthwise conv
  (`ssm_conv1d` + bias) and silu over xBC; the selective scan with A = `ssm_a`, dt = softplus(dt +
  `ssm_dt.bias`), head h reading group h // (heads / groups) of B and C; + D x (`ssm_d`); times
  silu(z); an RMS norm per group (`ssm_norm`); `ssm_out`.
- Attention: GQA without any positional encoding (no RoPE), scale 1/sqrt(head size), optional
  output bias. Its layers hold the model's only KV caches.
- MoE: sigmoid of the router logits, experts chosen on sigmoid + `exp_probs_b`, weighted by the
  unbiased sigmoid, normalised (`expert_weights_norm`) and scaled (`expert_weights_scale`); routed
  experts are ungated, relu(up x)^2 then down (two slabs per expert); plus an ungated relu^2 shared
  expert (`ffn_up_shexp`, `ffn_down_shexp`).
- Not supported: a latent MoE (`moe_latent_size`, Nemotron-3 Super), refused by name. MTP layers
  (`nextn_predict_layers`) at the end of the file are not computed.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...errors import ClutorError, ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..layers import gate, rmsnorm, silu
from ..state import FullKV, Recurrent
from ..recurrent import LayerShape, RecurrentState, conv_step, softplus, ssd_chunked, ssd_step, stacked
from .common import Arch, T, read_bool, read_common, read_float, read_int


def _per_layer(f, key: str, n: int) -> list[int]:
    """An array of n per-layer integers (a single number means the same for every layer)."""
    full = f"{f.arch}.{key}"
    v = f.get(full)
    if isinstance(v, int) and not isinstance(v, bool):
        return [v] * n
    if not isinstance(v, list) or len(v) < n or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                         for x in v[:n]):
        raise ModelFileError(f.path, full, f"{n} non-negative integers (one per layer)", repr(v)[:80])
    return list(v[:n])


def _uniform(f, key: str, values: list[int], what: str) -> int:
    if len(set(values)) != 1:
        raise UnsupportedError(f.path, f"{f.arch}.{key}", f"the same {what} in every layer", repr(values[:8]))
    return values[0]


class NemotronHMoE(Arch):
    name = "nemotron_h_moe"
    attention_kind = "GQA (no RoPE) + Mamba-2"

    def __init__(self, path, cfg, *, kinds: tuple[str, ...], n_nextn: int, conv_kernel: int, d_inner: int,
                 d_state: int, n_group: int, n_ssm_head: int, norm_w: bool, w_scale: float,
                 groups: tuple[int, int] | None):
        super().__init__(path, cfg)
        self.kinds, self.n_nextn = kinds, n_nextn
        self.conv_kernel, self.d_inner, self.d_state, self.n_group, self.n_ssm_head = (
            conv_kernel, d_inner, d_state, n_group, n_ssm_head)
        self.norm_w, self.w_scale, self.groups = norm_w, w_scale, groups
        self.group_of = np.arange(n_ssm_head) // (n_ssm_head // n_group)  # [H] repeat-interleave

    @classmethod
    def read(cls, f) -> "NemotronHMoE":
        a = f.arch
        n_all = read_int(f, "block_count", 1, 4096)
        n_nextn = read_int(f, "nextn_predict_layers", 0, n_all - 1, default=0)
        n = n_all - n_nextn
        latent = f.get(f"{a}.moe_latent_size", 0)
        if latent:
            raise UnsupportedError(f.path, f"{a}.moe_latent_size", "absent or 0 (a latent MoE, Nemotron-3 Super, is "
                                   "not supported)", repr(latent))
        hkv = _per_layer(f, "attention.head_count_kv", n)
        ff = _per_layer(f, "feed_forward_length", n)
        kinds = tuple("SSM" if hkv[l] == 0 and ff[l] == 0 else "attention" if ff[l] == 0 else "moe" for l in range(n))
        attn = tuple(l for l in range(n) if kinds[l] == "attention")
        moe = tuple(l for l in range(n) if kinds[l] == "moe")
        if not moe:
            raise UnsupportedError(f.path, f"{a}.feed_forward_length", "some MoE layers (> 0)", "none")
        n_head = read_int(f, "attention.head_count", 1, 4096)
        n_head_kv = _uniform(f, "attention.head_count_kv", [hkv[l] for l in attn], "kv heads") if attn else n_head
        used = _per_layer(f, "expert_used_count", n)
        n_used = _uniform(f, "expert_used_count", [used[l] for l in moe], "top-k")
        n_ff_exp = f.get(f"{a}.expert_feed_forward_length", None)
        if isinstance(n_ff_exp, list):
            _uniform(f, "expert_feed_forward_length", [n_ff_exp[l] for l in moe], "expert size")
        if f"{a}.attention.layer_norm_rms_epsilon" in f.metadata:
            eps = read_float(f, "attention.layer_norm_rms_epsilon")
        else:  # llama.cpp falls back to the LayerNorm epsilon
            eps = read_float(f, "attention.layer_norm_epsilon")
        hd = read_int(f, "attention.key_length", 1, 4096)
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_layers=n, n_head_kv=n_head_kv, head_dim=hd,
                          head_dim_v=read_int(f, "attention.value_length", 1, 4096, default=hd), eps=eps,
                          n_ff_shexp=read_int(f, "expert_shared_feed_forward_length", 1, MAX_DIM))
        if cfg.n_expert_used != n_used:
            raise ModelFileError(f.path, f"{a}.expert_used_count", "one top-k", cfg.n_expert_used)
        K = read_int(f, "ssm.conv_kernel", 2, 64)
        d_inner = read_int(f, "ssm.inner_size", 1, MAX_DIM)
        d_state = read_int(f, "ssm.state_size", 1, 4096)
        n_group = read_int(f, "ssm.group_count", 1, 4096)
        n_ssm_head = read_int(f, "ssm.time_step_rank", 1, 4096)
        if d_inner % n_ssm_head or d_inner % n_group or n_ssm_head % n_group:
            raise ModelFileError(f.path, f"{a}.ssm.time_step_rank", f"heads dividing ssm.inner_size {d_inner} and a "
                                 f"multiple of ssm.group_count {n_group}", n_ssm_head)
        n_grp = read_int(f, "expert_group_count", 0, 4096, default=0)
        groups = None
        if n_grp > 1:
            if cfg.n_expert % n_grp:
                raise ModelFileError(f.path, f"{a}.expert_group_count", f"a divisor of expert_count {cfg.n_expert}", n_grp)
            groups = (n_grp, read_int(f, "expert_group_used_count", 1, n_grp))
        shape = LayerShape(d_inner + 2 * n_group * d_state, K, (n_ssm_head, d_inner // n_ssm_head, d_state))
        cfg = replace(cfg, moe_layers=moe, kv_layers=attn, recurrent_bytes=shape.nbytes * kinds.count("SSM"))
        return cls(f.path, cfg, kinds=kinds, n_nextn=n_nextn, conv_kernel=K, d_inner=d_inner, d_state=d_state,
                   n_group=n_group, n_ssm_head=n_ssm_head, norm_w=read_bool(f, "expert_weights_norm", False),
                   w_scale=read_float(f, "expert_weights_scale", 0.0, positive=False), groups=groups)

    # -- tensors ----------------------------------------------------------------------------------
    def attention_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        D = cfg.n_embd
        want = {"attn_norm": T(b + "attn_norm.weight", (D,), "vector")}
        if self.kinds[l] == "SSM":
            di, GN, H = self.d_inner, self.n_group * self.d_state, self.n_ssm_head
            C = di + 2 * GN
            return want | {
                "ssm_in": T(b + "ssm_in.weight", (2 * di + 2 * GN + H, D)),
                "conv": T(b + "ssm_conv1d.weight", (C, self.conv_kernel), "vector"),
                "conv_b": T(b + "ssm_conv1d.bias", (C,), "vector", False),
                "dt_b": T(b + "ssm_dt.bias", (H,), "vector"),
                "ssm_a": T(b + "ssm_a", (H, 1), "vector"), "ssm_d": T(b + "ssm_d", (H, 1), "vector"),
                "ssm_norm": T(b + "ssm_norm.weight", (self.n_group, di // self.n_group), "vector"),
                "ssm_out": T(b + "ssm_out.weight", (D, di))}
        if self.kinds[l] == "attention":
            return super().attention_tensors(l) | {"bo": T(b + "attn_output.bias", (D,), "vector", False)}
        return want

    def ffn_tensors(self, l):
        if self.kinds[l] != "moe":
            return {}
        cfg, b = self.cfg, f"blk.{l}."
        D, E, F, S = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
        return {"router": T(b + "ffn_gate_inp.weight", (E, D), "vector"),
                "probs_b": T(b + "exp_probs_b.bias", (E,), "vector"),
                "up_exps": T(b + "ffn_up_exps.weight", (E, F, D), "expert", part="up"),
                "down_exps": T(b + "ffn_down_exps.weight", (E, D, F), "expert", part="down"),
                "sh_up": T(b + "ffn_up_shexp.weight", (S, D)), "sh_down": T(b + "ffn_down_shexp.weight", (D, S))}

    # -- compute ----------------------------------------------------------------------------------
    def layer_kind(self, l):
        return {"SSM": "SSM", "attention": "attention", "moe": "MoE"}[self.kinds[l]]

    def layer_states(self):
        """Mamba-2 layers their conv + SSM states, the attention layer its keys and values, MoE layers nothing."""
        cfg = self.cfg
        shape = LayerShape(self.d_inner + 2 * self.n_group * self.d_state, self.conv_kernel,
                           (self.n_ssm_head, self.d_inner // self.n_ssm_head, self.d_state))
        kv = FullKV(cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v)
        return [Recurrent(shape) if k == "SSM" else kv if k == "attention" else None for k in self.kinds]

    def attention(self, lw, l, x, step, rope):
        kind = self.kinds[l]
        if kind == "moe":
            return np.zeros_like(x)  # the layer is its FFN alone
        if kind == "SSM":
            return self.mamba2(lw, l, x, step)
        cfg, R = self.cfg, x.shape[0]
        q, k, v = self.qkv(lw, rmsnorm(x, lw.attn_norm, cfg.eps))
        o = step.attend(l, q, k, v, 1.0 / np.sqrt(cfg.head_dim))  # no positional encoding at all
        out = lw.wo(o)
        return out + lw.bo if lw.bo is not None else out

    def mamba2(self, lw, l, x, step):
        cfg, R = self.cfg, x.shape[0]
        di, G, N, H = self.d_inner, self.n_group, self.d_state, self.n_ssm_head
        hd = di // H
        zxbcdt = lw.ssm_in(rmsnorm(x, lw.attn_norm, cfg.eps))  # [R, 2 di + 2 G N + H]
        z, xbc, dt = zxbcdt[:, :di], zxbcdt[:, di : 2 * di + 2 * G * N], zxbcdt[:, 2 * di + 2 * G * N :]
        y = np.empty_like(xbc)
        for s in step.segments:
            if s.seq.rs.n != s.p0:
                raise ClutorError(f"recurrent state at position {s.seq.rs.n}, step at {s.p0}")
            rows = slice(s.r0, s.r0 + len(s.ids))
            y[rows] = conv_step(xbc[rows], s.seq.rs.conv[l], lw.conv, lw.conv_b)
        y = silu(y)
        xs = y[:, :di].reshape(R, H, hd)
        Bm = y[:, di : di + G * N].reshape(R, G, N)[:, self.group_of]  # [R, H, N]
        Cm = y[:, di + G * N :].reshape(R, G, N)[:, self.group_of]
        dt = softplus(dt + lw.dt_b).astype(np.float32)  # [R, H]
        A = lw.ssm_a.reshape(H)
        out = np.empty_like(xs)
        one = [s for s in step.segments if len(s.ids) == 1]
        if one:  # decoding sequences: one batched step over their stacked states
            r = np.array([s.r0 for s in one])
            out[r] = stacked([s.seq.rs.ssm[l] for s in one],  # [B, H, hd, N]
                             lambda h: ssd_step(xs[r], dt[r], A, Bm[r], Cm[r], h))
        for s in step.segments:
            if len(s.ids) > 1:
                rows = slice(s.r0, s.r0 + len(s.ids))
                out[rows] = ssd_chunked(xs[rows], dt[rows], A, Bm[rows], Cm[rows], s.seq.rs.ssm[l])
        out = (out + xs * lw.ssm_d.reshape(H, 1)) * silu(z.reshape(R, H, hd))
        out = rmsnorm(out.reshape(R, G, di // G), lw.ssm_norm, cfg.eps)  # per group
        return lw.ssm_out(out.reshape(R, di))

    def ffn_input(self, lw, x):
        return rmsnorm(x, lw.attn_norm, self.cfg.eps) if lw.router is not None else x

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, func="sigmoid", bias=lw.probs_b, norm=self.norm_w,
                    scale=self.w_scale, groups=self.groups)

    def expert_act(self, u, F):
        """relu(up)^2 of up [S, F] (the experts have no gate)."""
        return np.square(np.maximum(u, 0.0))

    def ffn_extra(self, lw, h):
        if lw.sh_up is None:
            return None
        return lw.sh_down(np.square(np.maximum(lw.sh_up(h), 0.0)))

    # -- info -------------------------------------------------------------------------------------
    def gating(self):
        return ("sigmoid + selection bias, top-k" + (", renormalised" if self.norm_w else "")
                + (f", scaled x{self.w_scale:g}" if self.w_scale not in (0.0, 1.0) else "")
                + (f", top {self.groups[1]} of {self.groups[0]} groups" if self.groups else "")
                + "; relu^2 experts and shared expert, ungated")

    def describe(self):
        d = super().describe()
        n = {k: self.kinds.count(k) for k in ("SSM", "attention", "moe")}
        d["attention"] = (f"{n['attention']} GQA (no RoPE) + {n['SSM']} Mamba-2 layers ({self.n_ssm_head} heads of "
                          f"{self.d_inner // self.n_ssm_head}, state {self.d_state}, {self.n_group} groups, conv "
                          f"{self.conv_kernel}), {n['moe']} MoE layers")
        d["rope"] = "none"
        d["dense_layers"] = 0
        return d | {"mtp_layers_skipped": self.n_nextn}

"""Qwen3.5 / Qwen3.6 MoE (`qwen35moe`: Qwen3.6-35B-A3B, Qwen3.5-35B/122B/397B): Qwen3-Next's layers
(clutor.model.arch.qwen3next) with three differences:

- b and a of the Gated DeltaNet come from two tensors, `ssm_beta` and `ssm_alpha`, not a fused one;
- v heads are tiled over the k heads (v head h uses k head h % k heads: llama.cpp's converter
  reorders the checkpoint's grouped heads so), not grouped;
- RoPE is interleaved M-RoPE (`rope.dimension_sections`, four section sizes): for text every
  section gets the token's position except the fourth, whose pairs get position 0 and do not turn.
"""
from __future__ import annotations

import numpy as np

from ...errors import ModelFileError
from ..layers import Rope
from ..quants import apply_all
from .common import T
from .qwen3next import Qwen3Next


def imrope_still(sections: list[int], n_rot: int) -> np.ndarray:
    """Which of the n_rot/2 rotary pairs keep position 0 under interleaved M-RoPE for text: pair i
    belongs to section (i mod sum) taken round-robin t, h, w while each lasts; the rest are the
    fourth (extra) section, which text tokens give position 0 (ggml's imrope sector rule)."""
    total = sum(sections)
    still = np.zeros(n_rot // 2, bool)
    for i in range(n_rot // 2):
        sector = i % total
        m = sector % 3
        still[i] = not (sector < 3 * sections[m])
    return still


class Qwen35MoE(Qwen3Next):
    name = "qwen35moe"
    grouped_v_heads = False

    @classmethod
    def read(cls, f):
        arch = super().read(f)
        key = f"{f.arch}.rope.dimension_sections"
        sec = f.get(key)
        if (not isinstance(sec, list) or not 1 <= len(sec) <= 4
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sec) or sum(sec) <= 0):
            raise ModelFileError(f.path, key, "up to four section sizes (non-negative, not all zero)", repr(sec))
        arch.sections = list(sec) + [0] * (4 - len(sec))
        return arch

    def beta_alpha_tensors(self, l):
        b, D = f"blk.{l}.", self.cfg.n_embd
        return {"wbeta": T(b + "ssm_beta.weight", (self.n_v, D)), "walpha": T(b + "ssm_alpha.weight", (self.n_v, D))}

    def beta_alpha(self, lw, h):
        b, a = apply_all((lw.wbeta, lw.walpha), h)  # [R, Hv] each
        return b, a

    def make_rope(self, n_ctx):
        cfg = self.cfg
        return Rope(cfg.n_rot, cfg.rope_base, n_ctx, style="neox", still=imrope_still(self.sections, cfg.n_rot))

    def describe(self):
        d = super().describe()
        d["rope"] += f", interleaved M-RoPE sections {self.sections}"
        return d

"""`v4_cpu_mhc`: DeepSeek-V4's hyper-connection (mHC) mixing in torch on CPU.

Each V4 sublayer mixes its `hc_mult` residual streams: from the RMS-scaled projection `mixes`
of the streams it derives `pre` (sigmoid), `post` (2 sigmoid) and a doubly-stochastic `comb`
(row softmax, then `sinkhorn_iters` alternating column / row normalisations), and feeds the
layer `sum_k pre[k] * stream[k]`. With the TileLang mHC kernels off (the `v4_cpu_defaults`
hook turns them off for a CPU launch), SGLang's decoder layer still calls two GPU kernels
(`DeepseekV4DecoderLayerBase.hc_pre`, `models/deepseek_v4.py:3483`):
- `hc_split_sinkhorn` (`kernels/ops/layernorm/mhc.py:427`) compiles TileLang's
  `hc_split_sinkhorn_kernel` (CUDA: fails on CPU);
- `mhc_combine` (`mhc.py:2743`) is a Triton kernel ("0 active drivers");
- the final head mix, `fused_hc_head` (`kernels/ops/layernorm/mhc_head.py:136`, from
  `DeepseekV4Model.hc_head`, `deepseek_v4.py:3935`), is a Triton kernel too.

On CPU tensors the hook computes both in torch with the kernels' float32 arithmetic, as
SGLang's own torch mHC (`_mhc_pre_torch`, `mhc.py:1900`) and the Triton sinkhorn port
(`_hc_split_sinkhorn_triton`) do: same formulas and iteration order; the head mix is SGLang's
own `hc_head_torch` (`deepseek_v4.py:664`, what the model runs on an empty batch).
"""

from __future__ import annotations

import torch

from sglang_dspark.plugin.registry import register_around

MHC = "sglang.kernels.ops.layernorm.mhc"


def hc_split_sinkhorn_torch(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """`mixes` `[b, s, (2 + hc) * hc]` -> (pre `[b, s, hc]`, post `[b, s, hc]`,
    comb `[b, s, hc, hc]`), float32, in `mixes`' dtype."""
    b, s, _ = mixes.shape
    n = hc_mult
    m = mixes.float()
    scale, base = hc_scale.float(), hc_base.float()
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = m[..., 2 * n :].reshape(b, s, n, n) * scale[2] + base[2 * n :].view(n, n)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre.to(mixes.dtype), post.to(mixes.dtype), comb.to(mixes.dtype)


def mhc_combine_torch(x_flat: torch.Tensor, pre: torch.Tensor, hc: int, out_dtype) -> torch.Tensor:
    """`y[m, h] = sum_k pre[m, k] * x_flat[m, k * H + h]`, accumulated in float32."""
    m = x_flat.shape[0]
    streams = x_flat.reshape(m, hc, -1).float()
    return (pre.float()[:, :, None] * streams).sum(1).to(out_dtype)


def _sinkhorn(original, mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    if mixes.device.type == "cpu":
        return hc_split_sinkhorn_torch(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)
    return original(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)


def _combine(original, x_flat, pre, hc, out_dtype):
    if x_flat.device.type == "cpu":
        return mhc_combine_torch(x_flat, pre, hc, out_dtype)
    return original(x_flat, pre, hc, out_dtype)


def _hc_head(original, x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps):
    if x.device.type != "cpu":
        return original(x, hc_fn, hc_scale, hc_base, norm_eps=norm_eps, hc_eps=hc_eps)
    from sglang.srt.models.deepseek_v4 import hc_head_torch

    return hc_head_torch(x, hc_fn, hc_scale, hc_base, norm_eps=norm_eps, hc_eps=hc_eps)


def install() -> None:
    register_around(f"{MHC}.hc_split_sinkhorn", _sinkhorn)
    register_around(f"{MHC}.mhc_combine", _combine)
    register_around("sglang.kernels.ops.layernorm.mhc_head.fused_hc_head", _hc_head)


HOOKS = {"v4_cpu_mhc": install}

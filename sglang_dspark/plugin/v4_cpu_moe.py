"""`v4_cpu_swiglu_clamp`: DeepSeek-V4's clamped SwiGLU on CPU, shared and routed experts.

V4 clamps both SwiGLU branches (`swiglu_limit`, 10 in the tiny V4): `gate <= limit`,
`-limit <= up <= limit`, then `silu(gate) * up`. On CPU, upstream 0.5.23:
- the shared expert (`DeepseekV2MLP.forward`, `models/deepseek_v2.py:490`) calls the JIT CUDA
  kernel `silu_and_mul_clamp` (`kernels/ops/activation/silu_and_mul_clamp.py:67`), whose build
  fails;
- the routed experts run `moe_forward_native` (`layers/moe/fused_moe_native.py:61`, from
  `UnquantizedFusedMoEMethod.forward_cpu`), which applies a plain `SiluAndMul` and ignores
  `moe_runner_config.swiglu_limit`: the experts compute without the clamp, silently wrong
  wherever a branch exceeds the limit.

On CPU tensors the hook computes the clamped SwiGLU as the CUDA kernel does
(`silu_and_mul_masked_post_quant.cuh`, `silu_and_mul<true>`): clamp in the input dtype, SiLU
and product in float32, one rounding to the output dtype; `gate` is the first half of each row.
With a `swiglu_limit` and the plain SiLU activation, `moe_forward_native` runs upstream's own
loop (tokens sorted by expert, `w13`, activation, `w2`, weighted sum in the router weights'
dtype) with that activation. Without a limit it is upstream's function, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_dspark.plugin.registry import register_around

CLAMP = "sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp"
NATIVE_MOE = "sglang.srt.layers.moe.fused_moe_native.moe_forward_native"


def silu_and_mul_clamp_torch(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """`[M, 2N]` -> `[M, N]`: `silu(min(gate, limit)) * clamp(up, -limit, limit)`."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit).float()
    up = up.clamp(-limit, limit).float()
    return (F.silu(gate) * up).to(gate_up.dtype)


def _silu_and_mul_clamp(original, input, output, swiglu_limit):
    if input.device.type != "cpu":
        return original(input, output, swiglu_limit)
    output.copy_(silu_and_mul_clamp_torch(input, float(swiglu_limit)))


def moe_forward_clamped(layer, x, topk_output, swiglu_limit: float) -> torch.Tensor:
    """Upstream's `moe_forward_native` loop with the clamped SwiGLU."""
    topk_weights, topk_ids, _ = topk_output
    counts = torch.bincount(topk_ids.reshape(-1).to(torch.int64), minlength=layer.num_experts)
    order = topk_ids.reshape(-1).argsort()
    sorted_tokens = x[order // topk_ids.shape[1]]
    outputs, start = [], 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        tokens = sorted_tokens[start : start + n]
        gate_up = F.linear(tokens, layer.w13_weight[expert])
        outputs.append(F.linear(silu_and_mul_clamp_torch(gate_up, swiglu_limit),
                                layer.w2_weight[expert]))  # fmt: skip
        start += n
    outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)
    unsorted = torch.empty_like(outs)
    unsorted[order] = outs
    weighted = unsorted.view(*topk_ids.shape, -1).type(topk_weights.dtype)
    return weighted.mul_(topk_weights.unsqueeze(-1)).sum(dim=1).type(unsorted.dtype)


def _moe_forward_native(original, layer, x, topk_output, moe_runner_config):
    limit = getattr(moe_runner_config, "swiglu_limit", None)
    if (
        limit is None
        or x.device.type != "cpu"
        or moe_runner_config.activation != "silu"
        or moe_runner_config.gemm1_alpha is not None
        or moe_runner_config.apply_router_weight_on_input
        or getattr(layer, "w13_weight_bias", None) is not None
        or getattr(layer, "w2_weight_bias", None) is not None
    ):
        return original(layer, x, topk_output, moe_runner_config)
    return moe_forward_clamped(layer, x, topk_output, float(limit))


def install() -> None:
    register_around(CLAMP, _silu_and_mul_clamp)
    register_around(NATIVE_MOE, _moe_forward_native)


HOOKS = {"v4_cpu_swiglu_clamp": install}

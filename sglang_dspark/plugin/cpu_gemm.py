"""`cpu_half_gemm_fp32`: bf16 / fp16 linears in float32 on CPUs without a half-precision GEMM.

On a CPU without AVX-512 (e.g. an AVX2-only AMD EPYC), oneDNN has no bf16 GEMM and torch's
`F.linear` on bf16 tensors falls back to a dot-product loop (`bf16_dot_with_fp32_arith`): its
cost grows linearly with the rows, about 15 ms per row for SmolLM2-135M's linears and LM head
on 2 cores, so verifying 8 tokens costs 8 decodes and a batch of 16 users 16 decodes: the
engine there has no regime in which speculation can pay. A float32 GEMM of the same bf16
values (MKL) is nearly flat in the rows up to dozens of them: the linears of one SmolLM2
forward took 468 ms (bf16) against 115 ms (float32) at 32 rows, 119 against 76 at 8 rows,
18 against 39 at one row (memory-bound: float32 reads twice the bytes); the LM head 127
against 39 ms at 32 rows (`benchmarks/cpu_gemm.py`).

The hook wraps SGLang's unquantized linear (`UnquantizedLinearMethod.apply`) and the LM head
(`LogitsProcessor._compute_lm_head`) on CPU tensors; the DSpark draft vocabulary's LM head and
Markov rows (`cpu_draft`) call `linear` here too. A call with at least `MIN_ROWS_ENV` rows
(default 6, the crossover measured on 2 cores) multiplies the bf16 input, upcast, by a float32
copy of the weight kept beside it (made at the first call, remade when the weight changes in
place) and rounds the result to the input's dtype: bf16 products are exact in float32 and both
GEMMs accumulate in float32, so the result is what a bf16 GEMM computes up to the order of the
sums. Fewer rows keep SGLang's own call. Memory: one float32 copy of every linear weight
(+540 MB for SmolLM2-135M).

Rows are padded to a multiple of 4 before the float32 GEMM: MKL's kernels compute 4 rows at a
time and use another summation order for the remainder, so without padding a row's result
would depend on how many rows share its batch. Padded, a row's result is the same in every
batch (tests/test_cpu_gemm.py). With `MIN_ROWS_ENV=1` every linear takes this path and the
engine is batch-invariant (a request's tokens do not depend on who shares its batch), as the
bf16 dot loop was; with the default threshold a request's rows take one path or the other by
the batch's row count, so greedy output can differ at near ties between batch sizes, as on
GPUs.

`SGLANG_DSPARK_CPU_GEMM=auto` (default: float32 where `torch.ops.mkldnn._is_mkldnn_bf16_supported()`
(fp16: `_is_mkldnn_fp16_supported()`) is false, i.e. where oneDNN has no half GEMM) | `float32`
(always) | `native` (SGLang's own call, the hook does nothing).
"""

from __future__ import annotations

import functools
import os

MODE_ENV = "SGLANG_DSPARK_CPU_GEMM"
MIN_ROWS_ENV = "SGLANG_DSPARK_CPU_GEMM_MIN_ROWS"
MODES = ("auto", "float32", "native")
DEFAULT_MIN_ROWS = 6
ROW_MULTIPLE = 4  # MKL's float32 kernel computes rows in groups of 4
LINEAR_APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
_FP32_ATTR = "_dspark_fp32_copy"


@functools.cache
def settings() -> tuple[str, int]:
    """(mode, minimum rows) from the environment, read once per process."""
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(
            f"{MODE_ENV}={mode!r} is not one of {', '.join(MODES)}: auto computes bf16 / fp16 "
            "linears with at least the minimum rows in float32 on CPUs without a half-precision "
            "GEMM, float32 does so everywhere, native leaves SGLang's call."
        )
    raw = os.environ.get(MIN_ROWS_ENV, "").strip()
    try:
        min_rows = int(raw) if raw else DEFAULT_MIN_ROWS
    except ValueError:
        min_rows = 0
    if min_rows < 1:
        raise ValueError(
            f"{MIN_ROWS_ENV}={raw!r} is not a whole number >= 1; 1 computes every half-precision "
            f"linear in float32 (a batch-invariant engine), {DEFAULT_MIN_ROWS} is the default."
        )
    return mode, min_rows


@functools.cache
def _native_half_gemm(dtype) -> bool:
    import torch

    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def applies(x, weight) -> bool:
    """Whether `x @ weight.T` takes the float32 path (by dtype, device and mode, not rows)."""
    import torch

    if x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if x.requires_grad or weight.requires_grad:
        return False
    mode, _ = settings()
    if mode == "native":
        return False
    return mode == "float32" or not _native_half_gemm(x.dtype)


def describe(dtype, device) -> str:
    """What a linear of this dtype on this device computes with: "native" or "float32>=N" (the
    SPS table's key: its step times depend on it)."""
    import torch

    probe = torch.empty(0, dtype=dtype, device=device)
    if not applies(probe, probe):
        return "native"
    return f"float32>={settings()[1]}"


def fp32_copy(weight):
    """The float32 copy kept on `weight` (remade when the weight was changed in place)."""
    import torch

    kept = getattr(weight, _FP32_ATTR, None)
    stamp = (weight.data_ptr(), weight._version, tuple(weight.shape))
    if kept is None or kept[0] != stamp:
        kept = (stamp, weight.detach().to(torch.float32).contiguous())
        setattr(weight, _FP32_ATTR, kept)
    return kept[1]


def linear(x, weight, bias=None):
    """`F.linear(x, weight, bias)`, in float32 when `applies` and the rows reach the minimum."""
    import torch.nn.functional as F

    if not applies(x, weight):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows < settings()[1]:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).float()
    pad = -rows % ROW_MULTIPLE
    if pad:
        flat = F.pad(flat, (0, 0, 0, pad))
    out = F.linear(flat, fp32_copy(weight), None if bias is None else bias.float())
    return out[:rows].to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _linear_apply(original, method, layer, x, bias=None):
    from sglang.srt.utils import use_intel_amx_backend

    if use_intel_amx_backend(layer) or not applies(x, layer.weight):
        return original(method, layer, x, bias)
    return linear(x, layer.weight, bias)


def _compute_lm_head(original, processor, hidden_states, lm_head, embedding_bias=None, *, out=None):
    """SGLang's plain `matmul(hidden.to(w.dtype), w.T)` branch, and only that one (LoRA, quantized
    heads, the fp32 LM head option, AMX and the RL on-policy path keep theirs)."""
    import sglang.srt.layers.logits_processor as lp
    from sglang.srt.utils import use_intel_amx_backend

    weight = getattr(lm_head, "weight", None)
    plain = (
        weight is not None
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not lp.should_apply_lm_head_quant_method(
            lm_head, getattr(lm_head, "quant_method", None)
        )
        and not processor.use_fp32_lm_head
        and getattr(processor, "rl_on_policy_target", None) is None
        and not use_intel_amx_backend(lm_head)
    )
    if plain:
        hidden = hidden_states.to(weight.dtype)
        if applies(hidden, weight):
            return linear(hidden, weight)
    return original(processor, hidden_states, lm_head, embedding_bias, out=out)


def install() -> None:
    from sglang.srt.utils import is_cpu

    from sglang_dspark.plugin.registry import register_around

    settings()  # a bad value stops the server here, not at the first request
    if not is_cpu():
        return
    register_around(LINEAR_APPLY, _linear_apply)
    register_around(LM_HEAD, _compute_lm_head)


HOOKS = {"cpu_half_gemm_fp32": install}

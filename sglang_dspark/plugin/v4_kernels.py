"""`SGLANG_DSPARK_V4_KERNELS`: which `dspark_kernels` implementation the V4 CPU hooks call.

The DeepSeek-V4 CPU hooks (`v4_cpu_norm_rope`, `v4_cpu_compressor`, `v4_cpu_index_topk`) stand
in for SGLang's CUDA kernels (and its torch top-k) with our package `dspark_kernels` (`kernels/`):

| call | `reference` (default) | `triton` |
|---|---|---|
| SWA KV store (`fused_k_norm_rope_flashmla`) | `kv_norm_rope_store_reference` | `kv_norm_rope_store` |
| indexer query (`fused_q_indexer_rope_hadamard_quant`) | `indexer_query_reference` | `indexer_query` |
| compressor pooling + state write (`compress_forward`) | torch (`compress_forward_torch`) | `compress_pool`, `compress_state_write` over `ragged_verify_plan` |
| compressor store (`compress_norm_rope_store`) | `kv_norm_rope_store_reference` / `index_k_store_reference` | `kv_norm_rope_store` / `index_k_store` |
| C4 indexer top-k (`topk_transform_pytorch_vectorized`) | `topk_transform_reference` | `topk_transform` |

On CPU tensors the Triton kernels run in Triton's interpreter, which has to be on when Triton
is first imported: a `--device cpu` V4 launch with `triton` sets `TRITON_INTERPRET=1` in the
launcher (hook `v4_cpu_defaults`), before SGLang spawns its processes. The variable is read
once per process (`v4_kernels()`), which logs the choice; a value outside `CHOICES` stops the
launch (and any routed call) with the fix.

The C4 indexer's logits stay SGLang's torch `fp8_paged_mqa_logits_torch` (selected by
`v4_cpu_defaults`); only its top-k is routed. The reference selects exactly as SGLang's torch
top-k (same call); the Triton selection keeps the same positions except among logits tied at the
top-k boundary, where torch's choice is unspecified (`v4_cpu_index_topk`). The fused
`dspark_kernels.index_topk` (float32 logits + top-k) is not routed: SGLang's logits round
through bf16, so its selections would differ.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

ENV = "SGLANG_DSPARK_V4_KERNELS"
REFERENCE, TRITON = "reference", "triton"
CHOICES = (REFERENCE, TRITON)
INTERPRET_ENV = "TRITON_INTERPRET"


class V4KernelsConfigError(ValueError):
    pass


def parse_v4_kernels(raw: str | None) -> str:
    """The implementation `raw` (the variable's value, None when unset) selects."""
    value = (raw or "").strip().lower()
    if not value:
        return REFERENCE
    if value not in CHOICES:
        raise V4KernelsConfigError(
            f"{ENV}={raw!r} is not one of {', '.join(CHOICES)}; set {ENV}=reference (the torch "
            f"references of dspark_kernels, the default) or {ENV}=triton (its Triton kernels; "
            "on CPU under Triton's interpreter), or unset it."
        )
    return value


@functools.cache
def v4_kernels() -> str:
    """This process's choice, read from the environment once and logged."""
    choice = parse_v4_kernels(os.environ.get(ENV))
    if choice == TRITON:
        logger.info(
            "sglang-dspark: DeepSeek-V4 CPU kernels: dspark_kernels' Triton kernels (%s=triton; "
            "%s=%s)", ENV, INTERPRET_ENV, os.environ.get(INTERPRET_ENV, "unset"),
        )  # fmt: skip
    else:
        logger.info(
            "sglang-dspark: DeepSeek-V4 CPU kernels: dspark_kernels' torch references (%s=%s; "
            "%s=triton selects the Triton kernels)", ENV, choice, ENV,
        )  # fmt: skip
    return choice


def use_triton() -> bool:
    return v4_kernels() == TRITON


def ensure_interpreter_for_cpu(environ: dict[str, str] | None = None) -> bool:
    """For a `--device cpu` launch: with `triton`, set TRITON_INTERPRET=1 when unset (True when
    this call set it). Raises on a bad switch value or a contradicting TRITON_INTERPRET."""
    env = os.environ if environ is None else environ
    if parse_v4_kernels(env.get(ENV)) != TRITON:
        return False
    have = env.get(INTERPRET_ENV, "").strip()
    if have == "1":
        return False
    if have:
        raise V4KernelsConfigError(
            f"{ENV}=triton on --device cpu runs dspark_kernels in Triton's interpreter, but "
            f"{INTERPRET_ENV}={have!r} is set; unset {INTERPRET_ENV} (the sglang-dspark plugin "
            f"sets it) or set {INTERPRET_ENV}=1, or use {ENV}=reference."
        )
    env[INTERPRET_ENV] = "1"
    return True


@functools.cache
def require_interpreter() -> None:
    """Before a Triton kernel runs on CPU tensors: Triton must have been imported under its
    interpreter (a compiled kernel cannot take CPU tensors)."""
    from dspark_kernels import kv_store
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kv_store._norm_rope_v4_store_kernel, InterpretedFunction)
    if not interpreted:
        raise RuntimeError(
            f"{ENV}=triton: dspark_kernels' Triton kernels got CPU tensors, but Triton was "
            f"imported without its interpreter; start the process with {INTERPRET_ENV}=1 (a "
            f"--device cpu launch sets it) or use {ENV}=reference."
        )

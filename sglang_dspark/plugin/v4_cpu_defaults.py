"""`v4_cpu_defaults`: a DeepSeek-V4 launch with `--device cpu` selects SGLang's torch paths.

SGLang 0.5.23 has torch (or no-kernel) alternatives for several V4 kernels, each behind a
switch whose default is the CUDA kernel; with the defaults a CPU server dies at its first
forward (or on loading):

| switch | default (CUDA) | CPU |
|---|---|---|
| `SGLANG_FP8_PAGED_MQA_LOGITS_TORCH` | DeepGEMM `fp8_paged_mqa_logits` (indexer) | 1: `fp8_paged_mqa_logits_torch` |
| `--dsa-topk-backend`, `--speculative-dsa-topk-backend` | `sgl-kernel` `topk_transform_paged` | `torch` (its selection routed to `dspark_kernels` by `v4_cpu_index_topk`) |
| `SGLANG_OPT_USE_FUSED_HASH_TOPK` | fused hash routing kernel | 0: torch `tid2eid` lookup |
| `SGLANG_OPT_USE_TILELANG_MHC_PRE`, `..._POST` | TileLang mHC (and `_prewarm_mhc_kernels` queries CUDA at load) | 0: torch mHC |
| `SGLANG_OPT_DEEPGEMM_HC_PRENORM` | DeepGEMM tf32 mHC pre-norm GEMM on long batches | 0: torch |
| `SGLANG_OPT_FLASHMLA_SPARSE_PREFILL` | FlashMLA sparse prefill kernel | 0: the decode kernel's path (`v4_cpu_sparse_attention`) |

When V4's argument defaults are applied (`apply_deepseek_v4_defaults`,
`arg_groups/deepseek_v4_hook.py`) and the device is `cpu`, the launcher sets every variable
that is unset to its CPU value, before SGLang starts any process (they inherit them), and
declares the torch top-k backends where the CUDA default `sgl-kernel` is in place. A value
that contradicts the CPU choice (e.g. `SGLANG_OPT_USE_TILELANG_MHC_PRE=1`,
`--dsa-topk-backend flashinfer`) is refused with the line that fixes it.

With `SGLANG_DSPARK_V4_KERNELS=triton` (`v4_kernels`) it also sets `TRITON_INTERPRET=1` where
unset, so the processes SGLang spawns import Triton under its interpreter (the hooks' Triton
kernels then take CPU tensors); a bad switch value or `TRITON_INTERPRET` other than 1 is
refused with the fix.
"""

from __future__ import annotations

import logging
import os

from sglang_dspark.plugin import v4_kernels
from sglang_dspark.plugin.registry import register_before

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults"

CPU_ENV = {
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": True,
    "SGLANG_OPT_USE_FUSED_HASH_TOPK": False,
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": False,
    "SGLANG_OPT_USE_TILELANG_MHC_POST": False,
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": False,
    "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL": False,
}
TOPK_FIELDS = {
    "dsa_topk_backend": "--dsa-topk-backend",
    "speculative_dsa_topk_backend": "--speculative-dsa-topk-backend",
}
TOPK_CUDA_DEFAULT = "sgl-kernel"


class V4CpuConfigError(ValueError):
    pass


def _as_bool(raw: str) -> bool | None:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def apply_cpu_env(environ: dict[str, str] | None = None) -> list[str]:
    """Set each unset V4 CPU switch; returns the names set here. Raises on a contradiction."""
    env = os.environ if environ is None else environ
    set_here, wrong = [], []
    for name, want in CPU_ENV.items():
        raw = env.get(name, "").strip()
        if not raw:
            env[name] = "1" if want else "0"
            set_here.append(name)
        elif _as_bool(raw) is not want:
            wrong.append(f"{name}={raw!r}")
    if wrong:
        fix = " ".join(
            f"{n}={'1' if CPU_ENV[n] else '0'}" for n in (w.split("=")[0] for w in wrong)
        )
        raise V4CpuConfigError(
            f"DeepSeek-V4 on --device cpu runs SGLang's torch paths, but {', '.join(wrong)} "
            f"selects a CUDA kernel; unset it (the sglang-dspark plugin sets it) or set {fix}."
        )
    return set_here


def topk_backends(view) -> dict[str, str]:
    """The top-k backend fields to declare `torch` for a CPU launch. Raises on a choice that
    is neither the CUDA default nor torch."""
    declared = {}
    for field, flag in TOPK_FIELDS.items():
        have = getattr(view, field)
        if have == "torch":
            continue
        if have != TOPK_CUDA_DEFAULT:
            raise V4CpuConfigError(
                f"DeepSeek-V4 on --device cpu needs the torch indexer top-k, but {flag} {have} "
                f"is CUDA-only; drop {flag} (the sglang-dspark plugin selects torch) or pass "
                f"{flag} torch."
            )
        declared[field] = "torch"
    return declared


def _v4_defaults_for_cpu(server_args, model_arch) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    view = resolving_view(server_args)
    if not str(view.device or "").startswith("cpu"):
        return
    for name in apply_cpu_env():
        logger.info("sglang-dspark: DeepSeek-V4 on --device cpu: %s=%s set for this launch",
                    name, os.environ[name])  # fmt: skip
    if v4_kernels.ensure_interpreter_for_cpu():
        logger.info("sglang-dspark: DeepSeek-V4 on --device cpu with %s=triton: %s=1 set for "
                    "this launch", v4_kernels.ENV, v4_kernels.INTERPRET_ENV)  # fmt: skip
    declared = topk_backends(view)
    if declared:
        declare_resolution(server_args, "sglang-dspark v4_cpu_defaults", **declared)
        logger.info("sglang-dspark: DeepSeek-V4 on --device cpu: %s", ", ".join(
            f"{TOPK_FIELDS[f]} torch" for f in declared))  # fmt: skip


def install() -> None:
    register_before(TARGET, _v4_defaults_for_cpu)


HOOKS = {"v4_cpu_defaults": install}

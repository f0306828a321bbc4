"""`cpu_engine_for_device_cpu`: `--device cpu` selects SGLang's CPU engine by itself.

Upstream 0.5.23 serves on a CPU only with `SGLANG_USE_CPU_ENGINE=1` in the environment; with
`--device cpu` alone the launcher resolves the arguments happily and the scheduler process
dies loading the model (`ModuleNotFoundError: No module named 'vllm'`, from the rotary
embedding's non-CPU path). SGLang reads the variable through `is_cpu()` (cached) and the
platform probe, in every process it starts.

When argument resolution reaches the CPU backends with the device `cpu` and the variable is
unset, we set it in the launcher's environment. That is before any scheduler, detokenizer or
tokenizer process starts (they inherit it and see the CPU engine from their first import), and
we clear the launcher's cached `is_cpu()`. A contradicting explicit value is refused with the
line that fixes it.
"""

from __future__ import annotations

import logging
import os

from sglang_dspark.plugin.registry import register_before

logger = logging.getLogger(__name__)

ENV = "SGLANG_USE_CPU_ENGINE"


class CpuEngineConfigError(ValueError):
    pass


def ensure_cpu_engine(device: str | None, environ: dict[str, str] | None = None) -> bool:
    """Set SGLANG_USE_CPU_ENGINE=1 for a CPU device; True when this call set it."""
    env = os.environ if environ is None else environ
    if not str(device or "").startswith("cpu"):
        return False
    have = env.get(ENV)
    if have == "1":
        return False
    if have is not None and have.strip() != "":
        raise CpuEngineConfigError(
            f"--device cpu needs SGLang's CPU engine ({ENV}=1), but {ENV}={have!r} is set; "
            f"unset {ENV} (the sglang-dspark plugin then sets it) or set {ENV}=1."
        )
    env[ENV] = "1"
    return True


def _cpu_engine_for_cpu_device(server_args) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view

    if ensure_cpu_engine(resolving_view(server_args).device):
        from sglang.srt.utils import common

        common.is_cpu.cache_clear()
        logger.info(
            "sglang-dspark: --device cpu: %s=1 set for this launch (SGLang's CPU engine)", ENV
        )


def install() -> None:
    register_before(
        "sglang.srt.arg_groups.platform_hook.handle_cpu_backends", _cpu_engine_for_cpu_device
    )


HOOKS = {"cpu_engine_for_device_cpu": install}

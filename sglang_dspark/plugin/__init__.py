"""The SGLang plugin: every change sglang-dspark makes to SGLang 0.5.23, as named hooks.

SGLang calls `register()` in every process (entry point group `sglang.srt.plugins`). Each
change lives in its own module under this package and is listed in `HOOKS`; none is applied
twice. `SGLANG_DSPARK_DISABLE_HOOKS=name,name` turns individual hooks off (for tests that show
the failure on an unmodified SGLang).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_registered = False


def _hooks():
    from sglang_dspark.plugin import (
        cpu_attention,
        cpu_dspark,
        cpu_eagle,
        cpu_kernels,
        cpu_markov,
        cpu_sampling,
        draft_validation,
        scheduling,
        sts_collect,
    )

    return {
        **cpu_kernels.HOOKS,
        **cpu_dspark.HOOKS,
        **cpu_eagle.HOOKS,
        **cpu_attention.HOOKS,
        **cpu_markov.HOOKS,
        **cpu_sampling.HOOKS,
        **draft_validation.HOOKS,
        **scheduling.HOOKS,
        **sts_collect.HOOKS,
    }


def disabled_hooks() -> set[str]:
    raw = os.environ.get("SGLANG_DSPARK_DISABLE_HOOKS", "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def register() -> None:
    """Entry point: register every enabled hook with SGLang's HookRegistry."""
    global _registered
    if _registered:
        return
    _registered = True
    off = disabled_hooks()
    for name, install in _hooks().items():
        if name in off:
            logger.info("sglang-dspark hook %s disabled by SGLANG_DSPARK_DISABLE_HOOKS", name)
            continue
        install()

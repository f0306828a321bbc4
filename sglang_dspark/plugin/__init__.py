"""The SGLang plugin: every change sglang-dspark makes to SGLang 0.5.23, as named hooks.

SGLang calls `register()` in every process (entry point group `sglang.srt.plugins`). Each
change lives in its own module under this package and is listed in `HOOKS`; none is applied
twice. `SGLANG_DSPARK_DISABLE_HOOKS=name,name` turns individual hooks off (for tests that show
the failure on an unmodified SGLang).

`register()` fails loudly. SGLang logs and swallows an exception from a plugin or from hook
application and starts unhooked, so a refusal raises `PluginRefusal` (a `SystemExit`, which
SGLang's loader does not catch): the process exits with status 1 and the message, before any
model loads. It refuses an sglang other than the supported release (unless
`SGLANG_DSPARK_ALLOW_SGLANG_VERSION` names the installed one), and any hook whose install
raises, whose SGLang target does not resolve or has another signature than the one the hook
was written against, or that is not in place after application (`registry.install_checked`).
"""

from __future__ import annotations

import logging
import os

from sglang_dspark import SGLANG_VERSION

logger = logging.getLogger(__name__)

ALLOW_VERSION_ENV = "SGLANG_DSPARK_ALLOW_SGLANG_VERSION"
DISABLE_ENV = "SGLANG_DSPARK_DISABLE_HOOKS"

_registered = False


class PluginRefusal(SystemExit):
    """sglang-dspark cannot run on this SGLang; the message says why and what to do.

    A SystemExit, because SGLang's plugin loader catches `Exception` and would carry on."""


def _hooks():
    from sglang_dspark.plugin import (
        cpu_accept,
        cpu_attention,
        cpu_draft,
        cpu_dspark,
        cpu_eagle,
        cpu_engine,
        cpu_gemm,
        cpu_kernels,
        cpu_markov,
        cpu_memory,
        cpu_paged_alloc,
        cpu_sampling,
        draft_validation,
        plain_rounds,
        scheduling,
        sts_collect,
        v4_chat_encoding,
        v4_cpu_attention,
        v4_cpu_compressor,
        v4_cpu_defaults,
        v4_cpu_index_pages,
        v4_cpu_index_topk,
        v4_cpu_kv_pool,
        v4_cpu_metadata,
        v4_cpu_mhc,
        v4_cpu_moe,
        v4_cpu_norm_rope,
        v4_cpu_rope,
        v4_validation,
        verify_trace,
    )

    return {
        **cpu_engine.HOOKS,
        **cpu_kernels.HOOKS,
        **cpu_gemm.HOOKS,
        **cpu_dspark.HOOKS,
        **cpu_eagle.HOOKS,
        **cpu_attention.HOOKS,
        **cpu_markov.HOOKS,
        **cpu_memory.HOOKS,
        **cpu_sampling.HOOKS,
        **cpu_accept.HOOKS,
        **cpu_draft.HOOKS,
        **plain_rounds.HOOKS,
        **draft_validation.HOOKS,
        **scheduling.HOOKS,
        **sts_collect.HOOKS,
        **verify_trace.HOOKS,
        **cpu_paged_alloc.HOOKS,
        **v4_cpu_defaults.HOOKS,
        # after v4_cpu_defaults: on the same target, so its check runs first
        **v4_validation.HOOKS,
        **v4_chat_encoding.HOOKS,
        **v4_cpu_rope.HOOKS,
        **v4_cpu_kv_pool.HOOKS,
        **v4_cpu_metadata.HOOKS,
        **v4_cpu_attention.HOOKS,
        **v4_cpu_compressor.HOOKS,
        **v4_cpu_norm_rope.HOOKS,
        **v4_cpu_index_topk.HOOKS,
        **v4_cpu_index_pages.HOOKS,
        **v4_cpu_mhc.HOOKS,
        **v4_cpu_moe.HOOKS,
    }


def disabled_hooks() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def installed_sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def version_problem(found: str, environ: dict[str, str] | None = None) -> str | None:
    """Why this plugin refuses sglang `found`, or None when it runs on it."""
    env = os.environ if environ is None else environ
    if found == SGLANG_VERSION:
        return None
    allowed = env.get(ALLOW_VERSION_ENV, "").strip()
    if allowed == found:
        logger.warning(
            "sglang-dspark: running on sglang %s (supported: %s) because %s=%s; every hook's "
            "target and signature is still checked",
            found, SGLANG_VERSION, ALLOW_VERSION_ENV, allowed,
        )  # fmt: skip
        return None
    return (
        f"sglang-dspark supports sglang=={SGLANG_VERSION}, but sglang {found} is installed"
        + (f" ({ALLOW_VERSION_ENV}={allowed} names another version)" if allowed else "")
        + f"; SGLang was not started. Install the supported release (`pip install "
        f"sglang=={SGLANG_VERSION}`), or, to run on sglang {found} knowingly (every hook's "
        f"target and signature is still checked at start-up), set {ALLOW_VERSION_ENV}={found}."
    )


def refusal_message(found: str, failing: dict[str, list[str]]) -> str:
    lines = [
        f"sglang-dspark cannot hook sglang {found}: {len(failing)} hook(s) failed; "
        + "SGLang was not started."
    ]
    for name, problems in failing.items():
        lines += [f"  - {name}: {p}" for p in problems]
    lines.append(
        f"Fix: use sglang=={SGLANG_VERSION} (`pip install sglang=={SGLANG_VERSION}`, then "
        "`sglang-dspark patches apply`), or start without these hooks knowingly: "
        f"{DISABLE_ENV}={','.join(failing)} (what each one fixes stays broken; see "
        "sglang_dspark/plugin/README.md)."
    )
    return "\n".join(lines)


def refuse(message: str) -> None:
    """Stop this process: status 1, `message` on stderr (Python prints a SystemExit's text)."""
    logger.critical("sglang-dspark refused to start SGLang: %s", message.splitlines()[0])
    raise PluginRefusal(message)


def register() -> None:
    """Entry point: check the sglang version, install and verify every enabled hook.

    Any other exception (a hook module that fails to import, a bug in an install) also stops
    the process: SGLang's loader would log it and start the server with no hooks at all."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        _register()
    except PluginRefusal:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever fails must stop the launch
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        refuse(
            f"sglang-dspark failed while registering its hooks: {type(exc).__name__}: {exc} "
            f"(at {where.filename}:{where.lineno}); SGLang was not started, because without "
            "its hooks it would run unmodified. Check that sglang-dspark and sglang=="
            f"{SGLANG_VERSION} are installed together (`pip install -e .` in the checkout, "
            "then `sglang-dspark patches apply`); if it persists, report it with this message."
        )


def _register() -> None:
    found = installed_sglang_version()
    problem = version_problem(found)
    if problem:
        refuse(problem)
    from sglang_dspark.plugin.registry import install_checked

    off = disabled_hooks()
    enabled = {}
    for name, install in _hooks().items():
        if name in off:
            logger.info("sglang-dspark hook %s disabled by %s", name, DISABLE_ENV)
        else:
            enabled[name] = install
    failing = {c.name: c.problems for c in install_checked(enabled) if c.problems}
    if failing:
        refuse(refusal_message(found, failing))

"""CPU serving memory: `cpu_scheduler_malloc_trim` and `cpu_onednn_primitive_cache`.

`cpu_scheduler_malloc_trim`: the CPU scheduler gives freed heap memory back to the system.

On the CPU engine every tensor lives in glibc malloc's heap. glibc raises its mmap threshold to
the size of each freed mmapped block (up to 32 MiB), so after the first vocabulary-sized logits
buffer every per-step tensor (logits, the verify pass's gathered keys and masks, which grow by a
token each step) comes from the main heap, and the free holes between live blocks are never
returned. Upstream 0.5.23's DSPARK scheduler grew by 2-3 MB per finished request, steadily, in a
10-minute soak at 16 users (docs/soak, `benchmarks/soak.py`): the heap's free-but-kept part went
from 36 to 211 MB in 3 minutes while live Python objects, requests and tensors stayed flat, and
one `malloc_trim(0)` in the running scheduler gave 126 MB back at once.

The hook starts one daemon thread in each CPU scheduler process, just before its event loop,
that calls glibc's `malloc_trim(0)` every `SGLANG_DSPARK_MALLOC_TRIM_SECONDS` (default 5; 0
turns it off). A trim costs milliseconds and holds malloc's lock only while it runs (ctypes
releases the GIL). The alternative, a fixed mmap threshold
(`mallopt(M_MMAP_THRESHOLD, 1 MiB)` in the scheduler), was measured and rejected: in a 10-minute
soak at 16 users it served 3.2x fewer tokens (0.134 against 0.043 CPU s per output token: every
large per-step tensor becomes a fresh mmap with its page faults) and still grew.

`cpu_onednn_primitive_cache`: oneDNN (torch's bf16 matmuls on CPU) keeps one JIT-compiled
primitive per matmul shape, up to `ONEDNN_PRIMITIVE_CACHE_CAPACITY` (default 1024). Compact
verify makes a new batch-token count almost every step, so on the CPU engine that cache is a
slow leak of a few MB per finished request that trimming cannot return (trimmed soak: +149 MB
over the second half of 10 minutes). When argument resolution reaches the CPU backends with the
device `cpu` and the variable is unset, the launcher sets it to 16 before any SGLang process
starts (they inherit it; oneDNN reads it once, at its first primitive). An explicit value is
kept. Recorded in docs/measurements.md (paired soak).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

from sglang_dspark.plugin.registry import register_before

logger = logging.getLogger(__name__)

PERIOD_ENV = "SGLANG_DSPARK_MALLOC_TRIM_SECONDS"
DEFAULT_PERIOD_S = 5.0
THREAD_NAME = "sglang-dspark-malloc-trim"


def trim_period(environ: dict[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(PERIOD_ENV, "").strip()
    if not raw:
        return DEFAULT_PERIOD_S
    try:
        period = float(raw)
    except ValueError:
        period = -1.0
    if period < 0:
        raise ValueError(
            f"{PERIOD_ENV}={raw!r} is not a number of seconds >= 0; set it to e.g. 5, or 0 to "
            "turn the CPU scheduler's heap trimming off."
        )
    return period


def glibc_malloc_trim():
    """glibc's `malloc_trim` as a ctypes function, or None where libc is not glibc."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def start_trimmer(period_s: float) -> threading.Thread | None:
    """A daemon thread calling malloc_trim(0) every `period_s` seconds (None: not started)."""
    if period_s <= 0:
        return None
    for t in threading.enumerate():
        if t.name == THREAD_NAME:
            return t
    trim = glibc_malloc_trim()
    if trim is None:
        logger.info("sglang-dspark: no glibc malloc_trim here; the heap is not trimmed")
        return None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period_s):
            trim(0)

    thread = threading.Thread(target=loop, name=THREAD_NAME, daemon=True)
    thread.stop = stop  # type: ignore[attr-defined]
    thread.start()
    return thread


def _before_event_loop(scheduler) -> None:
    if str(getattr(scheduler, "device", "")).startswith("cpu"):
        period = trim_period()
        if start_trimmer(period) is not None:
            logger.info("sglang-dspark: CPU scheduler heap trimmed every %.1f s (%s)", period,
                        PERIOD_ENV)  # fmt: skip


def install() -> None:
    register_before("sglang.srt.managers.scheduler.Scheduler.run_event_loop", _before_event_loop)


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CPU_DEFAULT = "16"


def cap_onednn_cache(device: str | None, environ: dict[str, str] | None = None) -> bool:
    """Set oneDNN's primitive cache capacity for a CPU device when unset; True when set here."""
    env = os.environ if environ is None else environ
    if not str(device or "").startswith("cpu") or env.get(ONEDNN_CACHE_ENV, "").strip():
        return False
    env[ONEDNN_CACHE_ENV] = ONEDNN_CACHE_CPU_DEFAULT
    return True


def _onednn_cache_for_cpu_device(server_args) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view

    if cap_onednn_cache(resolving_view(server_args).device):
        logger.info("sglang-dspark: --device cpu: %s=%s set for this launch (oneDNN keeps one "
                    "kernel per matmul shape)", ONEDNN_CACHE_ENV, ONEDNN_CACHE_CPU_DEFAULT)  # fmt: skip


def install_onednn_cache() -> None:
    register_before(
        "sglang.srt.arg_groups.platform_hook.handle_cpu_backends", _onednn_cache_for_cpu_device
    )


HOOKS = {
    "cpu_scheduler_malloc_trim": install,
    "cpu_onednn_primitive_cache": install_onednn_cache,
}

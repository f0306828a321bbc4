"""CPU serving memory: `cpu_scheduler_malloc_trim` and `cpu_onednn_caches`.

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

`cpu_onednn_caches`: torch's bf16 matmuls on CPU go through ideep and oneDNN, which keep one
entry per matmul shape in two caches: ideep's computation cache (`LRU_CACHE_CAPACITY`) and
oneDNN's primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default.
Compact verify makes a new batch-token count almost every step, so on the CPU engine both fill
for hours: a slow leak of about 2.6 MB per finished request that trimming cannot return
(10-minute soak at 16 users: +172 MB over the second half with both at 1024, +99 MB with
oneDNN's at 16). A probe of 6000 bf16 matmuls at random M in 1..700 grew 324 MB with the
defaults, 199 / 174 MB with one cache at 16, 19 MB with both. When argument resolution
reaches the CPU backends with the device `cpu`, the launcher sets each variable that is unset
to 16, before any SGLang process starts (they inherit them; both are read once, at the first
matmul). An explicit value is kept. Recorded in docs/results.md (paired soaks).
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


# ideep's computation cache and oneDNN's primitive cache: one entry per matmul shape each.
SHAPE_CACHE_ENVS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
SHAPE_CACHE_CPU_CAPACITY = "16"


def cap_shape_caches(device: str | None, environ: dict[str, str] | None = None) -> list[str]:
    """For a CPU device, set each shape-cache capacity that is unset; returns those set here."""
    env = os.environ if environ is None else environ
    if not str(device or "").startswith("cpu"):
        return []
    unset = [name for name in SHAPE_CACHE_ENVS if not env.get(name, "").strip()]
    for name in unset:
        env[name] = SHAPE_CACHE_CPU_CAPACITY
    return unset


def _shape_caches_for_cpu_device(server_args) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view

    for name in cap_shape_caches(resolving_view(server_args).device):
        logger.info("sglang-dspark: --device cpu: %s=%s set for this launch (one cache entry "
                    "per matmul shape)", name, SHAPE_CACHE_CPU_CAPACITY)  # fmt: skip


def install_shape_caches() -> None:
    register_before(
        "sglang.srt.arg_groups.platform_hook.handle_cpu_backends", _shape_caches_for_cpu_device
    )


HOOKS = {
    "cpu_scheduler_malloc_trim": install,
    "cpu_onednn_caches": install_shape_caches,
}

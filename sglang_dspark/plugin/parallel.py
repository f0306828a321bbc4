"""Where this SGLang process sits in the server's parallel layout (its runtime context).

Every reader returns the single-process answer outside a server (or before SGLang has written
its parallel context), so that hooks and their tests run alike in and out of a scheduler.
"""

from __future__ import annotations


def _parallel():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def _read(name: str, default: int) -> int:
    try:
        return int(getattr(_parallel(), name) or default)
    except (AttributeError, ValueError, RuntimeError):  # unwritten outside a server
        return default


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 with one rank)."""
    return _read("tp_rank", 0)


def global_rank() -> int:
    """A rank unique across data- and tensor-parallel processes: dp_rank x tp_size + tp_rank
    (names per-process files such as the STS recorder's and the verify trace's)."""
    return _read("dp_rank", 0) * _read("tp_size", 1) + _read("tp_rank", 0)


def tp_cpu_group():
    """SGLang's tensor-parallel CPU (gloo) group, or None with one rank or outside a server."""
    if _read("tp_size", 1) <= 1:
        return None
    try:
        return _parallel().tp_group.cpu_group
    except (AttributeError, ValueError, RuntimeError):
        return None

"""Where a training run executes: device choice, torch.distributed, phase timing, stop signals."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.distributed as dist

from sglang_dspark.drafter.config import (
    DraftConfigError,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- trainer
class PhaseTimer:
    """Seconds per phase of the steps it is attached to (``trainer.timer = PhaseTimer(dev)``):
    target (features), drafter (backbone forward and backward), loss (vocabulary terms,
    forward and backward), optimizer (reduce, clip, step). The device is synchronised at each
    boundary, which costs time of its own: for benchmarks (``benchmarks/train_step.py``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


class StopSignals:
    """SIGTERM (a pod evicted, a job preempted, ``kill``) or Ctrl-C during training: the running
    step finishes, a checkpoint is saved and the run exits; a second signal acts at once.

    ``with StopSignals() as stop:`` installs the handlers (main thread only; elsewhere it
    installs nothing) and restores the previous ones on exit; ``stop.signum`` is the signal
    received, or None."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        self._restore()  # the next one is handled as before: Ctrl-C twice interrupts at once
        logger.warning("%s received: stopping after this step with a checkpoint (send it again "
                       "to stop at once)", signal.Signals(signum).name)  # fmt: skip

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()


def resolve_device(name: str) -> torch.device:
    """``TrainConfig.device`` as a torch device: auto = the local CUDA device when torch sees
    one (``LOCAL_RANK`` under torchrun), else the CPU; a bare ``cuda`` also means the local
    one. Refuses what this torch cannot run, with the fix."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise DraftConfigError(f"device {name!r} is not a device ({e}); use auto, cpu, cuda or "
                               "cuda:N") from e  # fmt: skip
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DraftConfigError(f"device {name!r}: the trainer runs on cpu or cuda; use auto, "
                               "cpu, cuda or cuda:N")  # fmt: skip
    if not torch.cuda.is_available():
        raise DraftConfigError(
            f"device {name!r}: torch {torch.__version__} sees no CUDA device here; use "
            "--device cpu (or auto, which picks the CPU when there is no GPU)"
        )
    index = dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise DraftConfigError(f"device cuda:{index}: this machine has "
                               f"{torch.cuda.device_count()} CUDA devices")  # fmt: skip
    return torch.device("cuda", index)


def to_device(obj: Any, device: torch.device) -> Any:
    """Every tensor of ``obj`` (a tensor, a dataclass of them, nested) on ``device``; other
    fields unchanged. A no-op for tensors already there (the CPU path copies nothing). CPU
    tensors go to a GPU through pinned memory, asynchronously: a copy from pageable memory
    would wait for the GPU's queued work first (a hidden sync per tensor)."""
    if isinstance(obj, torch.Tensor):
        if device.type == "cuda" and obj.device.type == "cpu":
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(t, device) for t in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        moved = {f.name: to_device(getattr(obj, f.name), device)
                 for f in dataclasses.fields(obj) if f.init}  # fmt: skip
        return dataclasses.replace(obj, **moved)
    return obj


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (through the process group's device: NCCL reduces
        CUDA tensors only)."""
        if self.world > 1:
            buf = t.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            if buf is not t:
                t.copy_(buf)
        return t


def _init_distributed(device: torch.device | None = None) -> _Dist:
    device = device or torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist(device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return _Dist(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def _use_bf16(precision: str, device: torch.device | None = None) -> bool:
    if precision == "fp32":
        return False
    if precision == "bf16":
        return True
    if precision != "auto":
        raise DraftConfigError(f"precision {precision!r} is not one of auto, bf16, fp32")
    if device is not None and device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - any failure means "no fast bf16"
        return False

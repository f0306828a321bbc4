"""The embedded default: SmolLM2-135M-Instruct + a DSpark drafter, served by SGLang on CPU.

`ensure()` prepares both directories (idempotent) and `launch_command()` gives the exact
`python -m sglang.launch_server --speculative-algorithm DSPARK ...` line with the settings a
2-core, no-GPU machine needs: the CPU engine, the torch_native attention backend, and a KV
cache sized to the machine (SGLang's default would reserve ~13 GB).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_dspark.cache import cache_dir

# The drafter this project trained for SmolLM2 (see its README for the command and seed).
SHIPPED_DRAFT = Path(__file__).resolve().parent / "assets" / "smollm2-dspark"
MAX_TOTAL_TOKENS = 16384
MAX_RUNNING_REQUESTS = 16

CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# Confidence-scheduled verification is on by default: Algorithm 1 (plugin.scheduling), with
# SPS profiled at start-up and the drafter's STS calibration when it ships one.
DEFAULT_SCHEDULER = "sync"
STS_FILE = "sts.json"


@dataclass(frozen=True)
class EmbeddedPaths:
    target: Path
    draft: Path
    draft_is_trained: bool


def random_draft_dir() -> Path:
    return cache_dir() / "smollm2-dspark-random"


def ensure(dtype: str = "bfloat16") -> EmbeddedPaths:
    """Convert SmolLM2 once and pick the drafter: the shipped trained one, else a random one."""
    from sglang_dspark.smollm2 import ensure_smollm2

    target = ensure_smollm2(dtype=dtype)
    if (SHIPPED_DRAFT / "config.json").exists():
        return EmbeddedPaths(target, SHIPPED_DRAFT, True)
    draft = random_draft_dir()
    if not (draft / "config.json").exists():
        import torch

        from sglang_dspark.drafter.checkpoint import init_random_draft

        init_random_draft(target, draft, seed=0, dtype=getattr(torch, dtype))
    return EmbeddedPaths(target, draft, False)


def launch_command(
    paths: EmbeddedPaths,
    *,
    port: int = 30000,
    dtype: str = "bfloat16",
    speculative: bool = True,
    extra: list[str] | None = None,
) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(paths.target),
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--dtype", dtype,
        "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        "--max-running-requests", str(MAX_RUNNING_REQUESTS),
        "--sleep-on-idle",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    if speculative:
        cmd += [
            "--speculative-algorithm", "DSPARK",
            "--speculative-draft-model-path", str(paths.draft),
        ]  # fmt: skip
        sts = Path(paths.draft) / STS_FILE
        if sts.is_file() and "--speculative-dspark-confidence-sts-path" not in (extra or []):
            cmd += ["--speculative-dspark-confidence-sts-path", str(sts)]
    return cmd + list(extra or [])


def launch_env(base: dict[str, str] | None = None, *, scheduler: str | None = None) -> dict[str, str]:
    """The CPU engine's environment; `SGLANG_DSPARK_SCHEDULER` defaults to sync (scheduling ON)
    unless the caller's environment or `scheduler` says otherwise."""
    env = dict(os.environ if base is None else base)
    env.update(CPU_ENV)
    if scheduler is not None:
        env["SGLANG_DSPARK_SCHEDULER"] = scheduler
    elif not env.get("SGLANG_RAGGED_VERIFY_MODE"):
        env.setdefault("SGLANG_DSPARK_SCHEDULER", DEFAULT_SCHEDULER)
    return env

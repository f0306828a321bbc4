"""The embedded default: SmolLM2-135M-Instruct + a DSpark drafter, served by SGLang on CPU.

`ensure()` prepares the target and both drafters (idempotent) and `launch_command()` gives the
exact `python -m sglang.launch_server ...` line with the settings a 2-core, no-GPU machine
needs: `--device cpu`, the torch_native attention backend, and a KV cache sized to the machine
(SGLang's default would reserve ~13 GB). No environment variable is needed: the plugin selects
SGLang's CPU engine for `--device cpu` (`cpu_engine_for_device_cpu`) and gives a DSPARK launch
the sync scheduler (the CPU default of `plugin.scheduling.default_mode`). Three arms share everything but
speculation:

- `dspark`: `--speculative-algorithm DSPARK` with the shipped DSpark drafter (the default);
- `mtp1`: the MTP-1 baseline, SGLang's EAGLE worker with one draft token per round
  (`--speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-eagle-topk 1
  --speculative-num-draft-tokens 2`) and the shipped MTP-style drafter;
- `plain`: no speculation.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_dspark.serving.cache import cache_dir

# The drafter this project trained for SmolLM2 (see its README for the command and seed).
SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "assets" / "smollm2-dspark"
# Its MTP-1 baseline: one NextN-style block, trained by the same trainer (see its README).
SHIPPED_MTP1_DRAFT = Path(__file__).resolve().parents[1] / "assets" / "smollm2-mtp1"
ARMS = ("dspark", "mtp1", "plain")
MTP1_ARGS = (
    "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2",
    # The baseline at its best: drafts sampled from q and verified against q (1 - TV), not the
    # argmax of q verified target-only (p(argmax q)).
    "--speculative-use-rejection-sampling",
)  # fmt: skip
MAX_TOTAL_TOKENS = 16384
MAX_RUNNING_REQUESTS = 16

# Confidence-scheduled verification is on by default (the plugin's sync mode: Algorithm 1, SPS
# profiled at start-up), with the drafter's STS calibration when it ships one.
STS_FILE = "sts.json"


@dataclass(frozen=True)
class EmbeddedPaths:
    target: Path
    draft: Path
    draft_is_trained: bool
    mtp1_draft: Path
    mtp1_is_trained: bool


def random_draft_dir() -> Path:
    return cache_dir() / "smollm2-dspark-random"


def random_mtp1_draft_dir() -> Path:
    return cache_dir() / "smollm2-mtp1-random"


def ensure(dtype: str = "bfloat16") -> EmbeddedPaths:
    """Convert SmolLM2 once and pick each drafter: the shipped trained one, else a random one."""
    import torch

    from sglang_dspark.serving.smollm2 import ensure_smollm2

    target = ensure_smollm2(dtype=dtype)
    draft, trained = SHIPPED_DRAFT, True
    if not (SHIPPED_DRAFT / "config.json").exists():
        from sglang_dspark.drafter.formats.checkpoint import init_random_draft

        draft, trained = random_draft_dir(), False
        if not (draft / "config.json").exists():
            init_random_draft(target, draft, seed=0, dtype=getattr(torch, dtype))
    mtp1, mtp1_trained = SHIPPED_MTP1_DRAFT, True
    if not (SHIPPED_MTP1_DRAFT / "config.json").exists():
        from sglang_dspark.drafter.formats.checkpoint import init_random_mtp_draft

        mtp1, mtp1_trained = random_mtp1_draft_dir(), False
        if not (mtp1 / "config.json").exists():
            init_random_mtp_draft(target, mtp1, seed=0, dtype=getattr(torch, dtype))
    return EmbeddedPaths(target, draft, trained, mtp1, mtp1_trained)


def launch_command(
    paths: EmbeddedPaths,
    *,
    port: int = 30000,
    dtype: str = "bfloat16",
    speculative: bool = True,
    arm: str = "dspark",
    extra: list[str] | None = None,
) -> list[str]:
    """The launch command of one arm (`speculative=False` is the `plain` arm)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose one of {', '.join(ARMS)}")
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
    if speculative and arm == "mtp1":
        cmd += [*MTP1_ARGS, "--speculative-draft-model-path", str(paths.mtp1_draft)]
    elif speculative and arm == "dspark":
        cmd += [
            "--speculative-algorithm", "DSPARK",
            "--speculative-draft-model-path", str(paths.draft),
        ]  # fmt: skip
        sts = Path(paths.draft) / STS_FILE
        if sts.is_file() and "--speculative-dspark-confidence-sts-path" not in (extra or []):
            cmd += ["--speculative-dspark-confidence-sts-path", str(sts)]
    return cmd + list(extra or [])


def launch_env(
    base: dict[str, str] | None = None, *, scheduler: str | None = None
) -> dict[str, str]:
    """`base` (default: this process's environment) with SGLANG_DSPARK_SCHEDULER=`scheduler`
    when given. Nothing else: the plugin sets up the CPU engine, the default scheduler and the
    CPU scheduler's heap trimming."""
    env = dict(os.environ if base is None else base)
    if scheduler is not None:
        env["SGLANG_DSPARK_SCHEDULER"] = scheduler
    return env

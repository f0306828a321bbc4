#!/usr/bin/env python3
"""Seconds per training step of the DSpark and MTP-1 trainers on this device, and where they go.

    python benchmarks/train_step.py [--kinds dspark,mtp] [--global-batch 8] [--micro-batch 2]
        [--steps 4] [--cache cold,warm] [--device auto] [--data DIR] [--json FILE]

Each arm builds the trainer from the shipped config (configs/smollm2-{dspark,mtp1}.json), starts
from the shipped drafter and the in-repo training data (recipes/data/smollm2-regen-t07), and
times ``--steps`` steps after one warm-up step, with the given global and micro batch:

- cold: no feature cache, so every step runs the target over its sequences (a first epoch);
- warm: the steps' target features already cached on the device (later epochs; the cache
  holds what the timed steps read, whatever --feature-cache-gb a real run would need).

Prints one table: seconds per step, sequences/s, LM-head positions/s, and the split of a step
between the target forward, the drafter (backbone forward + backward), the vocabulary loss
(draft and target LM heads, TV/CE/confidence, their backward), the optimizer, and the rest
(plan, micro-batch layout). The split comes from ``train.PhaseTimer``, which synchronises a GPU
at each phase boundary; on a GPU, seconds per step are therefore measured in a first pass
without it, and the split in a second pass with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"dspark": "configs/smollm2-dspark.json", "mtp": "configs/smollm2-mtp1.json"}
DRAFTS = {
    "dspark": "sglang_dspark/assets/smollm2-dspark",
    "mtp": "sglang_dspark/assets/smollm2-mtp1",
}
PHASES = ("target", "drafter", "loss", "optimizer")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def default_target() -> Path:
    from sglang_dspark.serving.cache import cache_dir

    return cache_dir() / "SmolLM2-135M-Instruct-bfloat16"


def measure(kind: str, cache: str, args: argparse.Namespace, work: Path, dtype: str = "") -> dict:
    from sglang_dspark.drafter.training.config import TrainConfig
    from sglang_dspark.drafter.training.registry import build_trainer
    from sglang_dspark.drafter.training.runtime import PhaseTimer

    cfg = TrainConfig.from_json(
        REPO / CONFIGS[kind], data=str(args.data), target=str(args.target),
        out_dir=str(work / f"{kind}-{cache}-{dtype}"), init_draft=str(REPO / DRAFTS[kind]),
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        steps=10_000, resume=False, progress=False, device=args.device,
        feature_cache_gb=1e6 if cache == "warm" else 0.0,  # warm: admit every sequence
        target_batch_size=1,  # warm: compute exactly the sequences the timed steps use
        loss_chunk_rows=args.loss_chunk_rows,
        **({"target_dtype": dtype} if dtype else {}),
    )  # fmt: skip
    trainer = build_trainer(cfg)
    dev = trainer.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    first = 1  # step 0 warms up (allocator, kernels); steps first.. are timed
    if cache == "warm":  # the timed steps' features, computed and cached ahead
        for step in range(first + args.steps):
            trainer._features([seq for seq, *_ in trainer._plan(step)])
    trainer.train_step()

    def run(timer: PhaseTimer | None) -> tuple[float, int]:
        trainer.step, trainer.timer = first, timer
        sync()
        t0, rows = time.perf_counter(), 0
        for _ in range(args.steps):
            rows += trainer.train_step().lm_head_positions
        sync()
        return (time.perf_counter() - t0) / args.steps, rows // args.steps

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        seconds, rows = run(None)
        timer = PhaseTimer(dev)
        split_total, _ = run(timer)
    else:  # no device to synchronise: one pass gives both
        timer = PhaseTimer(dev)
        seconds, rows = run(timer)
        split_total = seconds
    per_step = {p: timer.seconds.get(p, 0.0) / args.steps for p in PHASES}
    per_step["other"] = max(0.0, split_total - sum(per_step.values()))
    share = {p: v / split_total for p, v in per_step.items()}
    return {
        "kind": kind, "cache": cache, "device": device_name(dev), "target_dtype": cfg.target_dtype,
        "global_batch": args.global_batch, "micro_batch": args.micro_batch,
        "s_per_step": seconds, "seq_per_s": args.global_batch / seconds,
        "lm_head_rows_per_s": rows / seconds, "lm_head_rows_per_step": rows,
        "split_s": per_step, "split_share": share,
        "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    head = ("| arm | cache | target dtype | batch (global/micro) | s/step | seq/s | LM-head rows/s | "
            + " | ".join(f"{p} %" for p in (*PHASES, "other")) + " |")  # fmt: skip
    out = [head, "|" + " --- |" * (7 + len(PHASES) + 1)]
    for r in rows:
        shares = " | ".join(f"{100 * r['split_share'][p]:.0f}" for p in (*PHASES, "other"))
        out.append(
            f"| {r['kind']} | {r['cache']} | {r['target_dtype']} | {r['global_batch']}/{r['micro_batch']} | "
            f"{r['s_per_step']:.3f} | {r['seq_per_s']:.1f} | {r['lm_head_rows_per_s']:.0f} | {shares} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="dspark,mtp", help="comma list of dspark, mtp")
    ap.add_argument("--cache", default="cold,warm", help="comma list of cold, warm")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm")
    ap.add_argument("--loss-chunk-rows", type=int, default=8192)
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--target-dtype",
        default="",
        help="comma list, e.g. bfloat16,float32 (default: each config's own); on a CPU without "
        "AVX-512 torch's bfloat16 GEMM is a slow loop",
    )
    ap.add_argument("--data", type=Path, default=REPO / "recipes/data/smollm2-regen-t07")
    ap.add_argument(
        "--target",
        type=Path,
        default=None,
        help="target model directory (default: the embedded SmolLM2 in the cache)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    args.target = args.target or default_target()
    if not (args.target / "config.json").is_file():
        ap.error(f"no target model at {args.target}; run `sglang-dspark embedded` (or `make "
                 "setup`) first, or pass --target DIR")  # fmt: skip
    kinds = [k for k in args.kinds.split(",") if k]
    caches = [c for c in args.cache.split(",") if c]
    bad = sorted(set(kinds) - set(CONFIGS)) + sorted(set(caches) - {"cold", "warm"})
    if bad:
        ap.error(f"unknown arm(s) {bad}; --kinds takes dspark, mtp and --cache cold, warm")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    with tempfile.TemporaryDirectory(prefix="train-step-") as tmp:
        for kind in kinds:
            for cache in caches:
                for dtype in args.target_dtype.split(",") if args.target_dtype else [""]:
                    rows.append(measure(kind, cache, args, Path(tmp), dtype))
                    print(f"{kind}/{cache}/{rows[-1]['target_dtype']}: "
                          f"{rows[-1]['s_per_step']:.3f} s/step", file=sys.stderr)  # fmt: skip
    print(f"device: {rows[0]['device']}; torch {torch.__version__}; {args.steps} timed steps "
          "per arm after one warm-up step")  # fmt: skip
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

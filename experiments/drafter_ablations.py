#!/usr/bin/env python3
"""Paired drafter ablations: same data, steps and seed, one change per arm, one table.

    python experiments/drafter_ablations.py --data DATA --out RUNS --steps 250 \\
        --arms base,layers2,tinit,rank256,decay1.5

Each arm trains `configs/smollm2-dspark.json` from scratch against the embedded SmolLM2 target
with its one change (ARMS below); all arms share one disk feature store (`RUNS/features`), so
the target's forward over each sequence is paid once for the whole ablation. Arms that have
finished (`RUNS/<arm>/draft/config.json`) are not retrained; an interrupted arm resumes from
its last checkpoint. Then `sglang-dspark compare` runs every arm on the same prompts and seeds
(tau at temperature 1 and 0, the ratio to the first arm with a paired bootstrap interval) and
writes `RUNS/compare/comparison.{md,json,png}`.

    python experiments/drafter_ablations.py --data DATA --out RUNS --step-cost 20 \
        --arms base,topk64 --repeats 2

`--step-cost N` prices a step instead: each arm trains N steps from the feature store that the
ablation filled (so no arm pays the target's forward), the arms interleaved `--repeats` times
so that the load of a shared machine falls on each alike; prints and writes
`RUNS/step-cost.md`: seconds per step after `WARMUP_STEPS`, per repeat and their mean, and the
ratio to the first arm.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2-dspark.json"

# One change each against the shipped recipe's shape (configs/smollm2-dspark.json).
ARMS: dict[str, list[str]] = {
    "base": [],
    "layers2": ["--num-layers", "2"],
    "layers3": ["--num-layers", "3"],
    "tinit": ["--init-layers-from-target", "29"],  # the draft layer starts as the target's last
    "rank256": ["--markov-rank", "256"],
    "decay1.5": ["--decay", "1.5"],
    "decay7": ["--decay", "7"],  # = gamma
    "anchors96": ["--num-anchors", "96"],
    "dflash": ["--dflash"],  # the paper's DFlash baseline: no Markov bias (B_k = 0)
    "topk64": ["--target-topk", "64"],  # the target's top-64 + one bucket instead of its logits
}


def training_table(root: Path, arms: list[str]) -> str:
    """Per arm, from its metrics.jsonl: steps, seconds per step (the arms that read the shared
    feature store; the first arm also ran the target), LM-head positions, the acceptance proxy
    and loss over the last 20 steps. Seconds are wall-clock on whatever shared the machine."""
    import json

    lines = ["| arm | steps | s/step | LM-head positions | accept proxy (last 20) | loss (last 20) |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for arm in arms:
        path = root / arm / "metrics.jsonl"
        rows = [json.loads(x) for x in path.open() if x.strip()] if path.is_file() else []
        if not rows:
            lines.append(f"| {arm} | - | - | - | - | - |")
            continue
        last = rows[-20:]
        timed = [r for r in rows if "elapsed_s" in r]
        per_step = "-"
        if len(timed) > 5:  # elapsed_s restarts at a resume: the longest unbroken tail
            tail = [timed[-1]]
            for r in reversed(timed[:-1]):
                if r["elapsed_s"] >= tail[-1]["elapsed_s"]:
                    break
                tail.append(r)
            if len(tail) > 5:
                per_step = f"{(tail[0]['elapsed_s'] - tail[-1]['elapsed_s']) / (len(tail) - 1):.2f}"
        accept = sum(r["accept"] for r in last) / len(last)
        loss = sum(r["loss"] for r in last) / len(last)
        lines.append(f"| {arm} | {rows[-1]['step']} | {per_step} | "
                     f"{sum(r['lm_head_positions'] for r in rows):,} | {accept:.3f} | "
                     f"{loss:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


WARMUP_STEPS = 3  # first steps of a short run: allocator and thread-pool warm-up


def step_seconds(metrics: Path, warmup: int = WARMUP_STEPS) -> float:
    """Mean seconds per step of one run after its first `warmup` steps (from `elapsed_s`)."""
    import json

    rows = [json.loads(x) for x in metrics.open() if x.strip()]
    timed = [r for r in rows if "elapsed_s" in r][warmup:]
    if len(timed) < 2:
        raise SystemExit(f"{metrics}: fewer than {warmup + 2} timed steps; raise --step-cost")
    return (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"]) / (timed[-1]["step"] - timed[0]["step"])


def step_cost_table(root: Path, arms: list[str], repeats: int) -> str:
    """Per arm: s/step of each interleaved repeat (`root/<arm>-<k>/metrics.jsonl`), their mean,
    and the mean's ratio to the first arm's."""
    means = {}
    cells = {}
    for arm in arms:
        per = [step_seconds(root / f"{arm}-{k}" / "metrics.jsonl") for k in range(repeats)]
        cells[arm] = " / ".join(f"{x:.2f}" for x in per)
        means[arm] = sum(per) / len(per)
    lines = [f"| arm | s/step per repeat (after {WARMUP_STEPS} warm-up steps) | mean | / {arms[0]} |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for arm in arms:
        lines.append(f"| {arm} | {cells[arm]} | {means[arm]:.2f} | "
                     f"{means[arm] / means[arms[0]]:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def run(cmd: list[str], env_threads: int) -> None:
    import os

    print("+", shlex.join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(env_threads), "THP_MEM_ALLOC_ENABLE": "1"}
    subprocess.run(cmd, check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="training data (JSONL file or directory)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--arms",
        default="base,layers2,tinit,rank256",
        help=f"comma-separated, first = reference; known: {', '.join(ARMS)}",
    )
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=20, help="prompts per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperatures", default="1,0")
    parser.add_argument(
        "--step-cost",
        type=int,
        default=0,
        metavar="N",
        help="price a step instead: N steps per arm from the filled feature store",
    )
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per arm")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")

    from sglang_dspark.serving.smollm2 import ensure_smollm2

    target = ensure_smollm2()
    cli = [sys.executable, "-m", "sglang_dspark.cli"]
    store = args.out / "features"
    if args.step_cost:
        import shutil

        if not store.is_dir():
            parser.error(f"{store}: no feature store; run the ablation first (it fills one)")
        root = args.out / "step-cost"
        for k in range(args.repeats):
            for arm in arms:
                out = root / f"{arm}-{k}"
                shutil.rmtree(out, ignore_errors=True)
                run([*cli, "train", "--config", str(CONFIG), "--data", args.data,
                     "--target", str(target), "--out-dir", str(out),
                     "--steps", str(args.step_cost), "--seed", str(args.seed),
                     "--checkpoint-every", str(args.step_cost), "--feature-store", str(store),
                     "--no-progress", *ARMS[arm]], args.threads)  # fmt: skip
        table = step_cost_table(root, arms, args.repeats)
        (args.out / "step-cost.md").write_text(table)
        print(table, flush=True)
        return 0
    for arm in arms:
        out = args.out / arm
        if (out / "draft" / "config.json").is_file():
            print(f"{arm}: trained ({out / 'draft'})", flush=True)
            continue
        run([*cli, "train", "--config", str(CONFIG), "--data", args.data, "--target", str(target),
             "--out-dir", str(out), "--steps", str(args.steps), "--seed", str(args.seed),
             "--checkpoint-every", "25", "--feature-store", str(store), "--no-progress",
             *ARMS[arm]], args.threads)  # fmt: skip
    table = training_table(args.out, arms)
    (args.out / "training.md").write_text(table)
    print(table, flush=True)
    drafts = [x for a in arms for x in ("--draft", f"{a}={args.out / a / 'draft'}")]
    run([*cli, "compare", "--target", str(target), *drafts, "--out", str(args.out / "compare"),
         "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
         "--temperatures", args.temperatures], args.threads)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

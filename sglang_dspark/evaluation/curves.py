"""Held-out learning curves: ``sglang-dspark curves LABEL=RUN_DIR ... --out DIR``.

Reads each training run's ``eval.jsonl`` (written when the run had ``--eval-data``: per draft
position, the held-out mean of 1 - TV/2 against the target, and the accept length it implies)
and writes, side by side:

- ``curves.png``: implied accept length against optimizer steps, one line per run, and the
  position-1 acceptance (the expected acceptance of the first draft) beside it;
- ``curves.md``: a table per evaluated step, and each run's gain over its own first record
  and over the first run at the last step every run reached (the paired comparison);
- ``curves.json``: the same numbers.

Runs compared this way should share the held-out file and the evaluation seed (the same
blocks); the module checks that their block counts agree and says so when they do not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load_eval_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN/eval.jsonl`` sorted by step (the last one kept for a step)."""
    path = Path(run_dir) / "eval.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: train with --eval-data HELD_OUT (and --eval-every N) to "
            "record held-out acceptance"
        )
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
            _ = rec["accept"], rec["tau_estimate"], rec["positions"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not an eval record ({e})") from e
    if not by_step:
        raise ValueError(f"{path} holds no eval record")
    return [by_step[s] for s in sorted(by_step)]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per run: first and last records and the gain between them; across runs: every run's
    implied accept length at the last step all of them reached, as a ratio to the first run."""
    if not runs:
        raise ValueError("no runs to summarize")
    blocks = {label: recs[0]["positions"] for label, recs in runs.items()}
    same_blocks = len({tuple(b) for b in blocks.values()}) == 1
    common = set.intersection(*({r["step"] for r in recs} for recs in runs.values()))
    out: dict[str, Any] = {"same_blocks": same_blocks, "blocks": blocks, "runs": {}}
    for label, recs in runs.items():
        first, last = recs[0], recs[-1]
        out["runs"][label] = {
            "first_step": first["step"],
            "last_step": last["step"],
            "tau_first": first["tau_estimate"],
            "tau_last": last["tau_estimate"],
            "accept1_first": first["accept"][0],
            "accept1_last": last["accept"][0],
            "tau_gain": last["tau_estimate"] / first["tau_estimate"],
        }
    if common:
        step = max(common)
        at = {label: next(r for r in recs if r["step"] == step) for label, recs in runs.items()}
        ref = next(iter(at.values()))
        out["paired"] = {
            "step": step,
            "tau": {label: r["tau_estimate"] for label, r in at.items()},
            "ratio_to_first": {
                label: r["tau_estimate"] / ref["tau_estimate"] for label, r in at.items()
            },
            "accept": {label: r["accept"] for label, r in at.items()},
        }
    return out


def write_curves(runs: dict[str, list[dict[str, Any]]], out_dir: str | Path) -> list[Path]:
    """curves.png, curves.md and curves.json under ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)

    fig, (ax_tau, ax_a1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, recs in runs.items():
        steps = [r["step"] for r in recs]
        ax_tau.plot(steps, [r["tau_estimate"] for r in recs], marker="o", ms=3, label=label)
        ax_a1.plot(steps, [r["accept"][0] for r in recs], marker="o", ms=3, label=label)
    ax_tau.set(xlabel="optimizer step", ylabel="accept length (held out, implied)",
               title="1 + sum_k prod_{j<=k} a_j")  # fmt: skip
    ax_a1.set(xlabel="optimizer step", ylabel="a_1", title="first draft: held-out acceptance")
    for ax in (ax_tau, ax_a1):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = out / "curves.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)

    labels = list(runs)
    steps = sorted({r["step"] for recs in runs.values() for r in recs})
    lines = [
        "Held-out accept length implied by per-position acceptance (a_1 in brackets):",
        "",
        "| step | " + " | ".join(labels) + " |",
        "| --- |" + " --- |" * len(labels),
    ]
    for step in steps:
        cells = []
        for label in labels:
            rec = next((r for r in runs[label] if r["step"] == step), None)
            cells.append(
                "" if rec is None else f"{rec['tau_estimate']:.3f} ({rec['accept'][0]:.3f})"
            )
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    paired = summary.get("paired")
    if paired:
        lines += ["", f"At step {paired['step']} (every run), ratio to {labels[0]}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in paired["ratio_to_first"].items())]  # fmt: skip
    if not summary["same_blocks"]:
        warning = (
            "Warning: the runs were evaluated on different held-out blocks "
            f"({summary['blocks']}); the columns are not paired."
        )
        lines += ["", warning]
    md = out / "curves.md"
    md.write_text("\n".join(lines) + "\n")
    js = out / "curves.json"
    js.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2) + "\n")
    return [png, md, js]


def _run_arg(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep:
        return Path(text).name, text
    return label, path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=_run_arg,
                        help="LABEL=RUN_DIR (or RUN_DIR) of runs trained with --eval-data")  # fmt: skip
    parser.add_argument("--out", required=True, help="output directory")


def run(args: argparse.Namespace) -> int:
    runs = {label: load_eval_log(path) for label, path in args.runs}
    for path in write_curves(runs, args.out):
        print(path)
    print(Path(args.out, "curves.md").read_text())
    return 0

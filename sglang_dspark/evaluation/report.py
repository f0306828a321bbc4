"""Evaluator outputs: results.json, calibration.npz (for the STS fitter), PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sglang_dspark.evaluation.metrics import RunRecord, _sigmoid


def write_calibration(records: Sequence[RunRecord], gamma: int, path: str | Path) -> Path:
    """Per-round arrays for a calibration (STS) fitter, one row per verify round:

    accepted [R] (n, drafts accepted), confidence_logits [R, gamma] (raw; c = sigmoid),
    temperature [R], benchmark [R] (index into benchmark_names). Position k of round r is a
    (confidence, label) pair when k <= n + 1: label = k <= n (accepted given 1..k-1
    accepted); ``pair_*`` hold those pairs flattened (position is 1-based). The survival
    label of a_k = prod_{i<=k} c_i is simply accepted >= k.
    """
    names = sorted({r.benchmark for r in records})
    rows = [r for r in records if len(r.confidence_logits) == len(r.accepted)]
    n = np.array([x for r in rows for x in r.accepted], dtype=np.int64)
    logits = np.array([c for r in rows for c in r.confidence_logits], dtype=np.float32)
    logits = logits.reshape(-1, gamma)
    temp = np.array([r.temperature for r in rows for _ in r.accepted], dtype=np.float32)
    bench = np.array([names.index(r.benchmark) for r in rows for _ in r.accepted], dtype=np.int64)
    k = np.arange(1, gamma + 1)[None, :]
    seen = k <= n[:, None] + 1
    label = (k <= n[:, None])[seen]
    path = Path(path)
    np.savez(
        path,
        gamma=np.int64(gamma),
        benchmark_names=np.array(names),
        accepted=n,
        confidence_logits=logits,
        temperature=temp,
        benchmark=bench,
        pair_confidence=_sigmoid(logits[seen]).astype(np.float32),
        pair_logit=logits[seen],
        pair_label=label.astype(np.int8),
        pair_position=np.broadcast_to(k, logits.shape)[seen].astype(np.int64),
        pair_temperature=np.broadcast_to(temp[:, None], logits.shape)[seen],
        pair_benchmark=np.broadcast_to(bench[:, None], logits.shape)[seen],
    )
    return path


def write_plots(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """position_acceptance.png, threshold_sweep.png, tau.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    res, gamma = results["results"], results["gamma"]
    temps = list(res)
    paths = []

    def panels(title: str):
        fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
        fig.suptitle(title)
        return fig, axes[0]

    fig, axes = panels("Position-wise conditional acceptance P(accept k | 1..k-1 accepted)")
    for ax, t in zip(axes, temps, strict=True):
        for name, m in res[t]["benchmarks"].items():
            y = [_nan(v) for v in m["position_acceptance"]]
            ax.plot(range(1, gamma + 1), y, marker="o", label=f"{name} (tau {m['tau'] or 0:.2f})")
        ax.set(title=f"T = {t}", xlabel="draft position k", ylabel="acceptance", ylim=(0, 1.02))
        ax.set_xticks(range(1, gamma + 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "position_acceptance.png"))

    fig, axes = panels("Static confidence-threshold sweep")
    for ax, t in zip(axes, temps, strict=True):
        ax2 = ax.twinx()
        for i, (name, m) in enumerate(res[t]["benchmarks"].items()):
            if not m["sweep"]:
                continue
            color = f"C{i}"
            th = [s["threshold"] for s in m["sweep"]]
            acc = [_nan(s["acceptance_rate"]) for s in m["sweep"]]
            tau = [_nan(s["tau"]) for s in m["sweep"]]
            ax.plot(th, acc, marker="o", color=color, label=f"{name} acceptance")
            ax2.plot(th, tau, linestyle="--", color=color, label=f"{name} tau")
        ax.set(title=f"T = {t}", xlabel="threshold on prod c_i", ylabel="acceptance rate")
        ax.set_ylim(0, 1.02)
        ax2.set_ylabel("tau (dashed)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no sweep without a confidence head (MTP-1)
            ax.legend(fontsize=8, loc="lower left")
    paths.append(_save(fig, out_dir / "threshold_sweep.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(dict.fromkeys(b for t in temps for b in res[t]["benchmarks"]))
    width = 0.8 / max(len(temps), 1)
    for j, t in enumerate(temps):
        taus = [(res[t]["benchmarks"].get(b) or {}).get("tau") or 0.0 for b in names]
        bars = ax.bar(np.arange(len(names)) + j * width, taus, width, label=f"T = {t}")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(np.arange(len(names)) + width * (len(temps) - 1) / 2, names)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(ylabel="tau (tokens per round, bonus included)", title=f"Accepted length, gamma {gamma}")
    ax.legend()
    paths.append(_save(fig, out_dir / "tau.png"))
    return paths


def _nan(v: float | None) -> float:
    return np.nan if v is None else v


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_outputs(
    records: Sequence[RunRecord], results: dict[str, Any], out_dir: str | Path
) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cal = write_calibration(records, results["gamma"], out_dir / "calibration.npz")
    results = {**results, "files": {"calibration": cal.name}}
    plots = write_plots(results, out_dir)
    results["files"]["plots"] = [p.name for p in plots]
    path = out_dir / "results.json"
    path.write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    return {"results": path, "calibration": cal, **{p.stem: p for p in plots}}

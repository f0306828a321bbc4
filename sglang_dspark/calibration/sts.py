"""The STS fit and its metrics (pure maths on tensors): ECE, ROC-AUC, Brier, the temperatures."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.speculative.dspark_components.dspark_sts import DSparkStsCalibration

from sglang_dspark.calibration.data import StsData

logger = logging.getLogger(__name__)

DEFAULT_NUM_BINS = 15
_EPS = 1e-12


def apply_temperatures(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """c = sigmoid(logits / T_k) per position, as SGLang's confidence head applies STS."""
    t = torch.as_tensor(list(temperatures), dtype=torch.float64)
    return torch.sigmoid(logits.to(torch.float64) / t)


def expected_calibration_error(
    probs: torch.Tensor, labels: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> float:
    """ECE with `num_bins` equal-width bins; bin = floor(p * num_bins), p = 1 in the last."""
    p = probs.reshape(-1).to(torch.float64)
    y = labels.reshape(-1).to(torch.float64)
    if p.numel() == 0:
        return float("nan")
    b = (p * num_bins).long().clamp_(0, num_bins - 1)
    p_sum = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, b, p)
    y_sum = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, b, y)
    return float((p_sum - y_sum).abs().sum() / p.numel())


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC-AUC as the Mann-Whitney statistic (ties count one half); NaN for a single class."""
    s = scores.reshape(-1).to(torch.float64)
    y = labels.reshape(-1).bool()
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_s, order = torch.sort(s)
    _, counts = torch.unique_consecutive(sorted_s, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    avg_rank = ends - (counts.to(torch.float64) - 1) / 2  # 1-based mean rank of each tie group
    ranks = torch.empty_like(s)
    ranks[order] = torch.repeat_interleave(avg_rank, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    p = probs.reshape(-1).to(torch.float64)
    if p.numel() == 0:
        return float("nan")
    return float(((p - labels.reshape(-1).to(torch.float64)) ** 2).mean())


def _scores(
    probs: torch.Tensor, labels: torch.Tensor, num_bins: int, rank_by: torch.Tensor | None = None
) -> dict[str, float]:
    """ECE and Brier of `probs`; ROC-AUC of `rank_by` (a score in the same order) if given."""
    return {
        "ece": expected_calibration_error(probs, labels, num_bins),
        "auc": roc_auc(probs if rank_by is None else rank_by, labels),
        "brier": brier_score(probs, labels),
    }


def temperature_grid() -> torch.Tensor:
    """SGLang's grid, value for value: 41 temperatures log-spaced over 0.1..10 (in float32)."""
    return torch.logspace(math.log10(0.1), math.log10(10.0), steps=41).to(torch.float64)


def _best_temperature(
    prev: torch.Tensor, z: torch.Tensor, y: torch.Tensor, grid: torch.Tensor, num_bins: int
) -> float:
    """The grid value minimising ECE of prev * sigmoid(z / T) (first one on ties)."""
    eces = [expected_calibration_error(prev * torch.sigmoid(z / t), y, num_bins) for t in grid]
    return float(grid[int(np.argmin(eces))])


def fit(data: StsData, num_bins: int = DEFAULT_NUM_BINS, refine: bool = True) -> list[float]:
    """STS: T_1..T_gamma, left to right, each minimising ECE of the prefix survival a_k."""
    label, in_window = data.cumulative_labels()
    grid = temperature_grid()
    temps: list[float] = []
    prev = torch.ones(data.num_samples, dtype=torch.float64)  # a_{k-1} with T_<k fitted
    for k in range(data.gamma):
        z = data.logits[:, k]
        rows = in_window[:, k]
        if not bool(rows.any()):
            logger.warning("STS position %d has no labelled rows; keeping T = 1", k + 1)
            t = 1.0
        else:
            t = _best_temperature(prev[rows], z[rows], label[rows, k], grid, num_bins)
            if refine:
                i = int(torch.argmin((grid - t).abs()))
                lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.numel() - 1)]
                fine = torch.logspace(math.log10(lo), math.log10(hi), 41, dtype=torch.float64)
                t = _best_temperature(prev[rows], z[rows], label[rows, k], fine, num_bins)
        temps.append(t)
        prev = prev * torch.sigmoid(z / t)
    return temps


def evaluate(
    temperatures: Sequence[float], data: StsData, num_bins: int = DEFAULT_NUM_BINS
) -> dict[str, Any]:
    """Per-position ECE / ROC-AUC / Brier before (T = 1) and after STS.

    "conditional": c_k against accepted_k on the valid rows (what the head predicts);
    "cumulative": a_k against "1..k accepted" on the blocks whose window covered k (what the
    scheduler uses and STS fits).
    The conditional AUC ranks by z_k / T_k, the order sigmoid preserves: torch's CPU sigmoid can
    differ by an ulp between equal inputs (vectorised body vs scalar tail), which would break
    exact ties in c_k.
    """
    if len(temperatures) != data.gamma:
        raise ValueError(f"{len(temperatures)} temperatures for data with gamma={data.gamma}")
    label, in_window = data.cumulative_labels()
    t = torch.as_tensor(list(temperatures), dtype=torch.float64)
    scaled = {"before": data.logits, "after": data.logits / t}
    c = {stage: torch.sigmoid(z) for stage, z in scaled.items()}
    a = {k: torch.cumprod(v, dim=1) for k, v in c.items()}
    positions = []
    for k in range(data.gamma):
        v, kn = data.valid[:, k], in_window[:, k]
        positions.append(
            {
                "position": k + 1,
                "temperature": float(temperatures[k]),
                "num_valid": int(v.sum()),
                "num_in_window": int(kn.sum()),
                "accept_rate": float(data.accepted[v, k].double().mean())
                if bool(v.any())
                else None,
                "conditional": {
                    s: _scores(c[s][v, k], data.accepted[v, k], num_bins, scaled[s][v, k])
                    for s in c
                },
                "cumulative": {s: _scores(a[s][kn, k], label[kn, k], num_bins) for s in a},
            }
        )

    def mean_ece(kind: str, stage: str) -> float:
        vals = [p[kind][stage]["ece"] for p in positions if p["num_in_window"]]
        return float(np.mean(vals)) if vals else float("nan")

    return {
        "num_samples": data.num_samples,
        "gamma": data.gamma,
        "num_bins": num_bins,
        "temperatures": [float(t) for t in temperatures],
        "mean_cumulative_ece_before": mean_ece("cumulative", "before"),
        "mean_cumulative_ece_after": mean_ece("cumulative", "after"),
        "mean_conditional_ece_before": mean_ece("conditional", "before"),
        "mean_conditional_ece_after": mean_ece("conditional", "after"),
        "positions": positions,
    }


@dataclass(frozen=True)
class CalibrationResult:
    calibration: DSparkStsCalibration
    metrics: dict[str, Any]  # {"fit": evaluate(...), "heldout": evaluate(...) or None}
    heldout: StsData | None


def calibrate(
    data: StsData,
    heldout_fraction: float = 0.3,
    num_bins: int = DEFAULT_NUM_BINS,
    seed: int = 0,
    dataset: str | None = None,
    heldout_data: StsData | None = None,
) -> CalibrationResult:
    """Split, fit on one part, evaluate on both; ece_before/after from the held-out part.

    With `heldout_data` (e.g. blocks from other prompts) all of `data` is fitted and the
    held-out metrics come from `heldout_data` instead of a row split."""
    if heldout_data is not None:
        if heldout_data.gamma != data.gamma:
            raise ValueError(
                f"held-out data has gamma={heldout_data.gamma}, the fitting data {data.gamma}"
            )
        train, heldout, heldout_fraction = data, heldout_data, 0.0
    else:
        train, heldout = data.split(heldout_fraction, seed)
    temps = fit(train, num_bins)
    fit_metrics = evaluate(temps, train, num_bins)
    held_metrics = evaluate(temps, heldout, num_bins) if heldout is not None else None
    shown = held_metrics or fit_metrics
    ece_before = [p["cumulative"]["before"]["ece"] for p in shown["positions"]]
    ece_after = [p["cumulative"]["after"]["ece"] for p in shown["positions"]]
    if not all(math.isfinite(x) for x in ece_before + ece_after):
        ece_before, ece_after = [], []  # a position without labels: SGLang needs floats
    calibration = DSparkStsCalibration(
        temperatures=temps,
        dataset=dataset if dataset is not None else data.source,
        num_samples=train.num_samples,
        ece_before=ece_before,
        ece_after=ece_after,
    )
    metrics = {
        "heldout_fraction": heldout_fraction,
        "seed": seed,
        "fit": fit_metrics,
        "heldout": held_metrics,
    }
    return CalibrationResult(calibration, metrics, heldout)

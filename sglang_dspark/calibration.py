"""Sequential Temperature Scaling (STS) of the confidence head (DSPARK.md section 3).

The confidence head gives, per draft position k, a raw logit z_k; c_k = sigmoid(z_k / T_k) is the
probability that draft k survives GIVEN drafts 1..k-1 survived, and the scheduler needs the
prefix survival a_k = prod_{i<=k} c_i as an absolute probability. STS fits T_1..T_gamma left to
right: T_k minimises the Expected Calibration Error of a_k against the label "drafts 1..k all
accepted", with T_1..T_{k-1} held at their fitted values. Dividing a logit by T > 0 preserves the
order of c_k, so the per-position ROC-AUC of c_k never changes.

Data: `StsData` (logits, accepted, valid), each [N, gamma], and optionally verified [N].
valid[n, k] says position k was verified with 1..k-1 all accepted; accepted[n, k] is then its
outcome; verified[n] is how many drafts the block's verify window covered (default: all gamma).
The window matters when a scheduler truncated verification: the label "1..k accepted" is used
only for blocks whose window covered k. Blocks that failed before k but had a short window must
be left out too, or the rows kept depend on the outcome and a_k looks too optimistic (the fit
then drives T_k up: tests/test_calibration.py shows it). So a block verified only partly needs
its `verified` entry; without one the data is refused. Sources:
- our offline evaluator: `save_sts_data` / `load_sts_data` (.npz or .json, arrays `logits`,
  `accepted`, `valid`, optional `verified`);
- SGLang's collector (`SGLANG_DSPARK_STS_COLLECT_PATH=stem` writes `stem.<i>.pt` dicts of
  float32 [n, gamma] `logits` and `prefix_mask`, prefix_mask[n, k] = k < accepted drafts),
  read with `torch.load(weights_only=True)`.

Output: SGLang's own `DSparkStsCalibration` JSON (`--speculative-dspark-confidence-sts-path`),
where ece_before / ece_after are the per-position ECEs of a_k on the held-out rows (on the
fitting rows if there is no held-out split), a metrics JSON and a reliability diagram.

ECE: 15 equal-width bins on [0, 1] by default, |mean prediction - mean label| per bin weighted
by the bin's share of rows (as SGLang's `dspark_sts_fit`). The temperature grid is SGLang's
(41 log-spaced values in 0.1..10), refined by a second 41-point pass between the neighbours of
the best value.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.speculative.dspark_components.dspark_sts import DSparkStsCalibration

logger = logging.getLogger(__name__)

DEFAULT_NUM_BINS = 15
_EPS = 1e-12

__all__ = [
    "DEFAULT_NUM_BINS",
    "CalibrationResult",
    "StsData",
    "add_arguments",
    "apply_temperatures",
    "brier_score",
    "calibrate",
    "evaluate",
    "expected_calibration_error",
    "fit",
    "load_collector_shard",
    "load_data",
    "load_sts_data",
    "plot_reliability",
    "roc_auc",
    "run",
    "save_sts_data",
    "temperature_grid",
    "write_calibration",
    "write_metrics",
]


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class StsData:
    """Per-block confidence logits and verification outcomes, each [N, gamma]."""

    logits: torch.Tensor  # float64 raw confidence-head logits (before any temperature)
    accepted: torch.Tensor  # bool, meaningful where valid
    valid: torch.Tensor  # bool: position verified with every earlier position accepted
    verified: torch.Tensor | None = None  # [N] int64 drafts in the verify window; None: gamma
    source: str = ""

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape) for t in (self.logits, self.accepted, self.valid)}
        if len(shapes) != 1 or self.logits.dim() != 2:
            raise ValueError(
                "STS data needs logits, accepted and valid of one shape [N, gamma], got "
                f"{[tuple(t.shape) for t in (self.logits, self.accepted, self.valid)]}"
                + (f" in {self.source}" if self.source else "")
            )
        if not bool(torch.isfinite(self.logits).all()):
            raise ValueError(f"STS logits contain NaN or inf{self._where()}")
        ok_before = self.valid[:, :-1] & self.accepted[:, :-1]
        if bool((self.valid[:, 1:] & ~ok_before).any()):
            raise ValueError(
                "STS data marks a position valid although an earlier position was rejected or "
                f"not verified{self._where()}; valid[n, k] must imply valid and accepted at "
                "k-1 (a position is labelled only when all earlier drafts were accepted)"
            )
        window = self.window_mask()
        if bool((self.valid & ~window).any()):
            raise ValueError(f"STS data marks a position valid beyond its block's `verified` "
                             f"count{self._where()}")
        reachable = torch.ones_like(self.valid)
        reachable[:, 1:] = ok_before
        if bool((reachable & window & ~self.valid).any()):
            hint = ("pass `verified` (drafts in each block's verify window)"
                    if self.verified is None else "fix `valid` or `verified`")
            raise ValueError(
                "STS data has positions that were reachable (every earlier draft accepted) but "
                f"are not marked valid{self._where()}: the blocks were verified only partly; "
                + hint
            )

    def _where(self) -> str:
        return f" ({self.source})" if self.source else ""

    @property
    def num_samples(self) -> int:
        return int(self.logits.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])

    def window_mask(self) -> torch.Tensor:
        """[N, gamma] bool: position k lies inside the block's verify window."""
        if self.verified is None:
            return torch.ones_like(self.valid)
        return torch.arange(self.gamma)[None, :] < self.verified.to(torch.int64)[:, None]

    def cumulative_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(label, used), [N, gamma]: label = drafts 1..k all accepted; used = the window
        covered k (chosen before the outcome, so these rows are an unbiased sample)."""
        ok = self.valid & self.accepted
        label = torch.cumprod(ok.to(torch.int64), dim=1).bool()
        return label, self.window_mask()

    def rows(self, index: torch.Tensor) -> StsData:
        verified = None if self.verified is None else self.verified[index]
        return StsData(self.logits[index], self.accepted[index], self.valid[index], verified,
                       self.source)

    def split(self, heldout_fraction: float, seed: int = 0) -> tuple[StsData, StsData | None]:
        """Random row split into (fit, held-out); held-out is None for fraction 0."""
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout fraction must be in [0, 1), got {heldout_fraction}")
        n_held = round(self.num_samples * heldout_fraction)
        if n_held == 0:
            return self, None
        perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(seed))
        return self.rows(perm[n_held:]), self.rows(perm[:n_held])

    @staticmethod
    def concat(parts: Sequence[StsData], source: str = "") -> StsData:
        gammas = {p.gamma for p in parts}
        if len(gammas) != 1:
            raise ValueError(
                "STS data files disagree on gamma: "
                + ", ".join(f"{p.source or '?'}: {p.gamma}" for p in parts)
                + "; calibrate each block size separately"
            )
        verified = None
        if any(p.verified is not None for p in parts):
            verified = torch.cat([
                p.verified if p.verified is not None
                else torch.full((p.num_samples,), p.gamma, dtype=torch.int64)
                for p in parts
            ])
        return StsData(
            torch.cat([p.logits for p in parts]),
            torch.cat([p.accepted for p in parts]),
            torch.cat([p.valid for p in parts]),
            verified,
            source,
        )


def _as_data(logits, accepted, valid, verified, source: str) -> StsData:
    return StsData(
        torch.as_tensor(np.asarray(logits), dtype=torch.float64),
        torch.as_tensor(np.asarray(accepted)).bool(),
        torch.as_tensor(np.asarray(valid)).bool(),
        None if verified is None else torch.as_tensor(np.asarray(verified)).to(torch.int64),
        source,
    )


def save_sts_data(path: str | Path, logits, accepted, valid, verified=None) -> None:
    """Write the evaluator's STS data: `.npz` (arrays) or `.json` (nested lists).

    logits [N, gamma] raw confidence logits; accepted, valid [N, gamma] 0/1; verified [N]
    drafts in each block's verify window, only needed when verification was truncated
    (see `StsData`).
    """
    data = _as_data(logits, accepted, valid, verified, str(path))  # validates before writing
    arrays = {
        "logits": data.logits.numpy(),
        "accepted": data.accepted.numpy().astype(np.uint8),
        "valid": data.valid.numpy().astype(np.uint8),
    }
    if data.verified is not None:
        arrays["verified"] = data.verified.numpy()
    path = Path(path)
    if path.suffix == ".npz":
        with path.open("wb") as f:
            np.savez_compressed(f, **arrays)
    elif path.suffix == ".json":
        path.write_text(json.dumps({k: v.tolist() for k, v in arrays.items()}), encoding="utf-8")
    else:
        raise ValueError(f"STS data path {path} must end in .npz or .json")


def load_collector_shard(path: str | Path) -> StsData:
    """One shard of SGLang's collector (`SGLANG_DSPARK_STS_COLLECT_PATH`), as `StsData`.

    Upstream's collector labels a block by its count of accepted drafts (greedy match against
    the target's argmax), so every position up to the first rejection is valid. It does not
    record the verify window: in compact mode unverified drafts look rejected (an SGLang fault).
    The plugin's recorder (`sglang_dspark.plugin.sts_collect`) writes the same dict plus
    `verified` [n] (drafts in each block's verify window) and labels by the real verification
    outcome; positions past the window are then left out.
    """
    shard = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(shard, dict) or not {"logits", "prefix_mask"} <= set(shard):
        raise ValueError(
            f"{path} is not an SGLang STS collector shard (expected a dict with 'logits' and "
            "'prefix_mask' tensors, as written by StsDataRecorder)"
        )
    prefix = shard["prefix_mask"].bool()
    valid = torch.ones_like(prefix)
    valid[:, 1:] = prefix[:, :-1]
    verified = shard.get("verified")
    if verified is not None:
        verified = verified.to(torch.int64)
        valid &= torch.arange(prefix.shape[1])[None, :] < verified[:, None]
    return StsData(shard["logits"].to(torch.float64), prefix, valid, verified, source=str(path))


def load_sts_data(path: str | Path) -> StsData:
    """Read one file: .npz / .json from our evaluator, or .pt from SGLang's collector."""
    path = Path(path)
    if path.suffix == ".pt":
        return load_collector_shard(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    elif path.suffix == ".json":
        arrays = json.loads(path.read_text(encoding="utf-8"))
    else:
        raise ValueError(
            f"don't know how to read STS data from {path}: expected .npz/.json (offline "
            "evaluator) or .pt (SGLang collector shard)"
        )
    missing = {"logits", "accepted", "valid"} - set(arrays)
    if missing:
        raise ValueError(f"{path} lacks the arrays {sorted(missing)} (need logits, accepted, "
                         "valid, each [N, gamma])")
    return _as_data(arrays["logits"], arrays["accepted"], arrays["valid"],
                    arrays.get("verified"), str(path))


def load_data(specs: str | Sequence[str]) -> StsData:
    """Files or globs (e.g. 'stem.*.pt'), concatenated in sorted order."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    paths: list[str] = []
    for spec in specs:
        matched = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matched:
            raise FileNotFoundError(f"no STS data file matches {spec!r}")
        paths += matched
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"STS data file {p} does not exist")
    return StsData.concat([load_sts_data(p) for p in paths], source=",".join(specs))


# ---------------------------------------------------------------------------------------------
# Metrics


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


def _scores(probs: torch.Tensor, labels: torch.Tensor, num_bins: int,
            rank_by: torch.Tensor | None = None) -> dict[str, float]:
    """ECE and Brier of `probs`; ROC-AUC of `rank_by` (a score in the same order) if given."""
    return {
        "ece": expected_calibration_error(probs, labels, num_bins),
        "auc": roc_auc(probs if rank_by is None else rank_by, labels),
        "brier": brier_score(probs, labels),
    }


# ---------------------------------------------------------------------------------------------
# Fit


def temperature_grid() -> torch.Tensor:
    """SGLang's grid, value for value: 41 temperatures log-spaced over 0.1..10 (in float32)."""
    return torch.logspace(math.log10(0.1), math.log10(10.0), steps=41).to(torch.float64)


def _best_temperature(prev: torch.Tensor, z: torch.Tensor, y: torch.Tensor, grid: torch.Tensor,
                      num_bins: int) -> float:
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


def evaluate(temperatures: Sequence[float], data: StsData,
             num_bins: int = DEFAULT_NUM_BINS) -> dict[str, Any]:
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
        positions.append({
            "position": k + 1,
            "temperature": float(temperatures[k]),
            "num_valid": int(v.sum()),
            "num_in_window": int(kn.sum()),
            "accept_rate": float(data.accepted[v, k].double().mean()) if bool(v.any()) else None,
            "conditional": {
                s: _scores(c[s][v, k], data.accepted[v, k], num_bins, scaled[s][v, k]) for s in c
            },
            "cumulative": {s: _scores(a[s][kn, k], label[kn, k], num_bins) for s in a},
        })

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


def calibrate(data: StsData, heldout_fraction: float = 0.3, num_bins: int = DEFAULT_NUM_BINS,
              seed: int = 0, dataset: str | None = None,
              heldout_data: StsData | None = None) -> CalibrationResult:
    """Split, fit on one part, evaluate on both; ece_before/after from the held-out part.

    With `heldout_data` (e.g. blocks from other prompts) all of `data` is fitted and the
    held-out metrics come from `heldout_data` instead of a row split."""
    if heldout_data is not None:
        if heldout_data.gamma != data.gamma:
            raise ValueError(f"held-out data has gamma={heldout_data.gamma}, the fitting data "
                             f"{data.gamma}")
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
    metrics = {"heldout_fraction": heldout_fraction, "seed": seed, "fit": fit_metrics,
               "heldout": held_metrics}
    return CalibrationResult(calibration, metrics, heldout)


def _json_safe(obj: Any) -> Any:
    """NaN (e.g. AUC of a single-class position) becomes null: strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def write_metrics(metrics: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(_json_safe(metrics), indent=2), encoding="utf-8")


def write_calibration(calibration: DSparkStsCalibration, path: str | Path) -> None:
    """SGLang's STS file, encoded by SGLang's own class."""
    Path(path).write_text(calibration.to_json(), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Reliability diagram


def _reliability_curve(probs: torch.Tensor, labels: torch.Tensor, num_bins: int):
    b = (probs * num_bins).long().clamp_(0, num_bins - 1)
    count = torch.bincount(b, minlength=num_bins).double()
    p_mean = torch.bincount(b, probs, minlength=num_bins) / count.clamp_min(1)
    y_mean = torch.bincount(b, labels.double(), minlength=num_bins) / count.clamp_min(1)
    keep = count > 0
    return p_mean[keep].numpy(), y_mean[keep].numpy()


def plot_reliability(temperatures: Sequence[float], data: StsData, path: str | Path,
                     num_bins: int = DEFAULT_NUM_BINS, title: str = "") -> None:
    """One panel per position: empirical vs predicted prefix survival a_k, before and after."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no global state

    label, in_window = data.cumulative_labels()
    before = torch.cumprod(torch.sigmoid(data.logits), 1)
    after = torch.cumprod(apply_temperatures(data.logits, temperatures), 1)
    cols = min(data.gamma, 4)
    nrows = math.ceil(data.gamma / cols)
    fig = Figure(figsize=(3.2 * cols, 3.2 * nrows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, cols, squeeze=False)).ravel()
    for k, ax in enumerate(axes):
        if k >= data.gamma:
            ax.set_visible(False)
            continue
        kn = in_window[:, k]
        ax.plot([0, 1], [0, 1], color="0.6", lw=0.8, ls="--")
        for name, a, style in (("before", before, "o-"), ("after", after, "s-")):
            x, y = _reliability_curve(a[kn, k], label[kn, k], num_bins)
            ece = expected_calibration_error(a[kn, k], label[kn, k], num_bins)
            ax.plot(x, y, style, ms=3, label=f"{name} ECE {100 * ece:.1f}%")
        ax.set_title(f"a_{k + 1}  (T={temperatures[k]:.2f}, n={int(kn.sum())})", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted survival")
        ax.set_ylabel("observed")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title or f"STS reliability ({num_bins} bins)")
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# Command line: sglang-dspark calibrate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, nargs="+", metavar="FILE_OR_GLOB",
                        help="STS data: evaluator .npz/.json or SGLang collector shards "
                        "('stem.*.pt', quote the glob)")
    parser.add_argument("--out", required=True, type=Path,
                        help="SGLang STS calibration JSON to write "
                        "(--speculative-dspark-confidence-sts-path)")
    parser.add_argument("--heldout-fraction", type=float, default=0.3,
                        help="rows kept out of the fit and used for the reported ECE")
    parser.add_argument("--heldout-data", nargs="+", default=None, metavar="FILE_OR_GLOB",
                        help="evaluate on these blocks (e.g. other prompts) instead of a row "
                        "split of --data; all of --data is then fitted")
    parser.add_argument("--plot", type=Path, default=None, help="reliability diagram PNG")
    parser.add_argument("--metrics", type=Path, default=None,
                        help="metrics JSON (default: OUT with suffix .metrics.json)")
    parser.add_argument("--num-bins", type=int, default=DEFAULT_NUM_BINS, help="ECE bins")
    parser.add_argument("--seed", type=int, default=0, help="held-out split seed")
    parser.add_argument("--gamma", type=int, default=None,
                        help="fail unless the data has this block size")


def run(args: argparse.Namespace) -> int:
    data = load_data(args.data)
    if args.gamma is not None and args.gamma != data.gamma:
        raise ValueError(f"the data has gamma={data.gamma} but --gamma {args.gamma} was given; "
                         "collect data with the serving block size")
    logger.info("STS data: %d blocks, gamma=%d, from %s", data.num_samples, data.gamma,
                data.source)
    heldout = load_data(args.heldout_data) if args.heldout_data else None
    result = calibrate(data, args.heldout_fraction, args.num_bins, args.seed,
                       dataset=" ".join(args.data), heldout_data=heldout)
    write_calibration(result.calibration, args.out)
    metrics_path = args.metrics or args.out.with_suffix(".metrics.json")
    write_metrics(result.metrics, metrics_path)
    if args.plot is not None:
        plot_reliability(result.calibration.temperatures, result.heldout or data, args.plot,
                         args.num_bins)
    shown = result.metrics["heldout"] or result.metrics["fit"]
    where = "held-out" if result.metrics["heldout"] else "fit"
    print(f"STS on {where} rows ({shown['num_samples']}), {args.num_bins} ECE bins")
    print(f"{'pos':>3}  {'T':>7}  {'ECE(a_k) before':>15} -> {'after':>6}  {'AUC(c_k)':>8}  "
          f"{'Brier(a_k)':>10}")
    for p in shown["positions"]:
        cum, cond = p["cumulative"], p["conditional"]
        print(f"{p['position']:>3}  {p['temperature']:>7.3f}  {100 * cum['before']['ece']:>14.2f}%"
              f" -> {100 * cum['after']['ece']:>5.2f}%  {cond['after']['auc']:>8.3f}  "
              f"{cum['after']['brier']:>10.4f}")
    print(f"mean ECE of a_k: {100 * shown['mean_cumulative_ece_before']:.2f}% -> "
          f"{100 * shown['mean_cumulative_ece_after']:.2f}%")
    print(f"wrote {args.out} and {metrics_path}" + (f" and {args.plot}" if args.plot else ""))
    return 0

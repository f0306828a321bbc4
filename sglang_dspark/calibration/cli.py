"""`sglang-dspark calibrate`: fit, write SGLang's calibration file and metrics, draw the reliability diagram."""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.speculative.dspark_components.dspark_sts import DSparkStsCalibration

from sglang_dspark.calibration.data import StsData, load_data
from sglang_dspark.calibration.sts import (
    DEFAULT_NUM_BINS,
    apply_temperatures,
    calibrate,
    evaluate,
    expected_calibration_error,
)

logger = logging.getLogger(__name__)


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


def _reliability_curve(probs: torch.Tensor, labels: torch.Tensor, num_bins: int):
    b = (probs * num_bins).long().clamp_(0, num_bins - 1)
    count = torch.bincount(b, minlength=num_bins).double()
    p_mean = torch.bincount(b, probs, minlength=num_bins) / count.clamp_min(1)
    y_mean = torch.bincount(b, labels.double(), minlength=num_bins) / count.clamp_min(1)
    keep = count > 0
    return p_mean[keep].numpy(), y_mean[keep].numpy()


def plot_reliability(
    temperatures: Sequence[float],
    data: StsData,
    path: str | Path,
    num_bins: int = DEFAULT_NUM_BINS,
    title: str = "",
) -> None:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        metavar="FILE_OR_GLOB",
        help="STS data: evaluator .npz/.json or SGLang collector shards "
        "('stem.*.pt', quote the glob)",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        help="SGLang STS calibration JSON to write (--speculative-dspark-confidence-sts-path)",
    )
    parser.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.3,
        help="rows kept out of the fit and used for the reported ECE",
    )
    parser.add_argument(
        "--heldout-data",
        nargs="+",
        default=None,
        metavar="FILE_OR_GLOB",
        help="evaluate on these blocks (e.g. other prompts) instead of a row "
        "split of --data; all of --data is then fitted",
    )
    parser.add_argument("--plot", type=Path, default=None, help="reliability diagram PNG")
    parser.add_argument(
        "--metrics",
        type=Path,
        default=None,
        help="metrics JSON (default: OUT with suffix .metrics.json)",
    )
    parser.add_argument("--num-bins", type=int, default=DEFAULT_NUM_BINS, help="ECE bins")
    parser.add_argument("--seed", type=int, default=0, help="held-out split seed")
    parser.add_argument(
        "--gamma", type=int, default=None, help="fail unless the data has this block size"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="STS_JSON",
        help="an existing STS file (e.g. the one in use) scored on the same "
        "held-out rows, to decide whether the new fit replaces it",
    )


def load_baseline(path: Path, gamma: int) -> list[float]:
    """The temperatures of SGLang STS file `path`; ValueError naming the problem otherwise."""
    try:
        calibration = DSparkStsCalibration.from_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--baseline {path}: no such file") from None
    except (ValueError, TypeError, KeyError) as exc:  # bad JSON, missing or bad fields
        raise ValueError(f"--baseline {path} is not an SGLang STS file ({exc})") from None
    if len(calibration.temperatures) != gamma:
        raise ValueError(
            f"--baseline {path} has {len(calibration.temperatures)} temperatures but the data "
            f"has gamma={gamma}: it calibrates another block size"
        )
    return list(calibration.temperatures)


def run(args: argparse.Namespace) -> int:
    data = load_data(args.data)
    baseline = load_baseline(args.baseline, data.gamma) if args.baseline else None
    if args.gamma is not None and args.gamma != data.gamma:
        raise ValueError(
            f"the data has gamma={data.gamma} but --gamma {args.gamma} was given; "
            "collect data with the serving block size"
        )
    logger.info("STS data: %d blocks, gamma=%d, from %s", data.num_samples, data.gamma, data.source)
    heldout = load_data(args.heldout_data) if args.heldout_data else None
    result = calibrate(
        data,
        args.heldout_fraction,
        args.num_bins,
        args.seed,
        dataset=" ".join(args.data),
        heldout_data=heldout,
    )
    if baseline is not None:
        scored = evaluate(baseline, result.heldout or data, args.num_bins)
        result.metrics["baseline"] = {"path": str(args.baseline), **scored}
    write_calibration(result.calibration, args.out)
    metrics_path = args.metrics or args.out.with_suffix(".metrics.json")
    write_metrics(result.metrics, metrics_path)
    if args.plot is not None:
        plot_reliability(
            result.calibration.temperatures, result.heldout or data, args.plot, args.num_bins
        )
    shown = result.metrics["heldout"] or result.metrics["fit"]
    where = "held-out" if result.metrics["heldout"] else "fit"
    print(f"STS on {where} rows ({shown['num_samples']}), {args.num_bins} ECE bins")
    print(
        f"{'pos':>3}  {'T':>7}  {'ECE(a_k) before':>15} -> {'after':>6}  {'AUC(c_k)':>8}  "
        f"{'Brier(a_k)':>10}"
    )
    for p in shown["positions"]:
        cum, cond = p["cumulative"], p["conditional"]
        print(
            f"{p['position']:>3}  {p['temperature']:>7.3f}  {100 * cum['before']['ece']:>14.2f}%"
            f" -> {100 * cum['after']['ece']:>5.2f}%  {cond['after']['auc']:>8.3f}  "
            f"{cum['after']['brier']:>10.4f}"
        )
    print(
        f"mean ECE of a_k: {100 * shown['mean_cumulative_ece_before']:.2f}% -> "
        f"{100 * shown['mean_cumulative_ece_after']:.2f}%"
    )
    if baseline is not None:
        old = result.metrics["baseline"]
        per_position = " ".join(
            f"{100 * p['cumulative']['after']['ece']:.2f}%" for p in old["positions"]
        )
        print(
            f"baseline {args.baseline} on the same rows: mean ECE of a_k "
            f"{100 * old['mean_cumulative_ece_after']:.2f}% (per position: {per_position})"
        )
    print(f"wrote {args.out} and {metrics_path}" + (f" and {args.plot}" if args.plot else ""))
    return 0

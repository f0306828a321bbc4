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

Modules: `data` (StsData and its loaders), `sts` (the fit and metrics, pure maths), `cli`
(`sglang-dspark calibrate`: files, reliability diagram).

Output: SGLang's own `DSparkStsCalibration` JSON (`--speculative-dspark-confidence-sts-path`),
where ece_before / ece_after are the per-position ECEs of a_k on the held-out rows (on the
fitting rows if there is no held-out split), a metrics JSON and a reliability diagram.

ECE: 15 equal-width bins on [0, 1] by default, |mean prediction - mean label| per bin weighted
by the bin's share of rows (as SGLang's `dspark_sts_fit`). The temperature grid is SGLang's
(41 log-spaced values in 0.1..10), refined by a second 41-point pass between the neighbours of
the best value.
"""

from __future__ import annotations

from sglang_dspark.calibration.cli import (
    add_arguments,
    plot_reliability,
    run,
    write_calibration,
    write_metrics,
)
from sglang_dspark.calibration.data import (
    StsData,
    load_collector_shard,
    load_data,
    load_sts_data,
    save_sts_data,
)
from sglang_dspark.calibration.sts import (
    DEFAULT_NUM_BINS,
    CalibrationResult,
    apply_temperatures,
    brier_score,
    calibrate,
    evaluate,
    expected_calibration_error,
    fit,
    roc_auc,
    temperature_grid,
)

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

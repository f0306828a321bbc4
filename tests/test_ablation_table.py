"""benchmarks/drafter_ablations.py's training table: per-arm cost and proxies from metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import drafter_ablations


def _write(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_training_table_times_the_last_unbroken_run_and_averages_the_last_steps(tmp_path):
    # 30 steps: the first 10 before an interruption (2 s/step), 20 after a resume (3 s/step,
    # elapsed_s restarts); the old arm has no elapsed_s at all.
    rows = [{"step": i + 1, "elapsed_s": 2.0 * (i + 1), "accept": 0.1, "loss": 3.0,
             "lm_head_positions": 100} for i in range(10)]  # fmt: skip
    rows += [{"step": 11 + i, "elapsed_s": 5.0 + 3.0 * i, "accept": 0.2 + 0.01 * (i >= 10),
              "loss": 2.0, "lm_head_positions": 100} for i in range(20)]  # fmt: skip
    _write(tmp_path / "a", rows)
    _write(tmp_path / "old", [{"step": 1, "accept": 0.5, "loss": 1.0, "lm_head_positions": 7}])
    table = drafter_ablations.training_table(tmp_path, ["a", "old", "missing"])
    lines = table.splitlines()
    assert lines[2] == "| a | 30 | 3.00 | 3,000 | 0.205 | 2.000 |"
    assert lines[3] == "| old | 1 | - | 7 | 0.500 | 1.000 |"
    assert lines[4] == "| missing | - | - | - | - | - |"

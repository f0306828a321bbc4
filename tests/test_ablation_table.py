"""experiments/drafter_ablations.py's training table: per-arm cost and proxies from metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))

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


def test_step_cost_table_drops_warm_up_steps_and_pairs_repeats(tmp_path):
    # base: 1 s/step after a slow first step; topk64: 0.5 then 0.7 s/step in its two repeats
    def rows(first: float, per: float) -> list[dict]:
        return [{"step": i + 1, "elapsed_s": first + per * i} for i in range(10)]

    _write(tmp_path / "base-0", rows(9.0, 1.0))
    _write(tmp_path / "base-1", rows(5.0, 1.0))
    _write(tmp_path / "topk64-0", rows(9.0, 0.5))
    _write(tmp_path / "topk64-1", rows(9.0, 0.7))
    lines = drafter_ablations.step_cost_table(tmp_path, ["base", "topk64"], 2).splitlines()
    assert lines[2] == "| base | 1.00 / 1.00 | 1.00 | 1.000 |"
    assert lines[3] == "| topk64 | 0.50 / 0.70 | 0.60 | 0.600 |"


def test_step_cost_refuses_a_run_too_short_to_time(tmp_path):
    _write(tmp_path / "a", [{"step": i + 1, "elapsed_s": float(i)} for i in range(4)])
    try:
        drafter_ablations.step_seconds(tmp_path / "a" / "metrics.jsonl")
    except SystemExit as e:
        assert "raise --step-cost" in str(e)
    else:
        raise AssertionError("a 4-step run was timed")

"""`sglang-dspark curves`: held-out learning curves from training runs' eval.jsonl."""

from __future__ import annotations

import json

import pytest

from sglang_dspark.cli import main
from sglang_dspark.evaluation.curves import load_eval_log, summarize


def _log(run, recs):
    run.mkdir(parents=True, exist_ok=True)
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def _rec(step, accept, positions=(100, 90)):
    tau = 1 + accept[0] + accept[0] * accept[1]
    return {"step": step, "accept": list(accept), "positions": list(positions), "tau_estimate": tau}


def test_curves_pair_runs_at_their_last_common_step(tmp_path, capsys):
    a = _log(tmp_path / "a", [_rec(0, (0.3, 0.2)), _rec(50, (0.4, 0.3)), _rec(100, (0.5, 0.4))])
    # b was resumed: step 50 logged twice (the last record counts), and it stopped at 50
    b = _log(tmp_path / "b", [_rec(0, (0.3, 0.2)), _rec(50, (0.1, 0.1)), _rec(50, (0.6, 0.5))])
    s = summarize({"a": load_eval_log(a), "b": load_eval_log(b)})
    assert s["same_blocks"]
    assert s["paired"]["step"] == 50
    assert s["paired"]["ratio_to_first"]["b"] == pytest.approx((1 + 0.6 + 0.3) / (1 + 0.4 + 0.12))
    assert s["runs"]["a"]["tau_gain"] == pytest.approx((1 + 0.5 + 0.2) / (1 + 0.3 + 0.06))
    assert main(["curves", f"one={a}", f"two={b}", "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "curves.md").read_text()
    assert "| 100 | 1.700 (0.500) |  |" in md and "ratio to one: one 1.000, two 1.250" in md
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0
    assert "Warning" not in md


def test_curves_flag_unpaired_blocks_and_refuse_missing_logs(tmp_path, capsys):
    a = _log(tmp_path / "a", [_rec(0, (0.3, 0.2), positions=(100, 90))])
    b = _log(tmp_path / "b", [_rec(0, (0.3, 0.2), positions=(80, 70))])
    assert not summarize({"a": load_eval_log(a), "b": load_eval_log(b)})["same_blocks"]
    assert main(["curves", str(a), str(b), "--out", str(tmp_path / "o")]) == 0
    assert "not paired" in (tmp_path / "o" / "curves.md").read_text()
    assert main(["curves", str(tmp_path / "none"), "--out", str(tmp_path / "o2")]) == 2
    assert "--eval-data" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "eval.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="not an eval record"):
        load_eval_log(tmp_path / "bad")

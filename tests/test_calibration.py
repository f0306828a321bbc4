"""STS calibration: fitter, metrics, file formats (ours and SGLang's)."""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.speculative.dspark_components.dspark_sts import (
    DSparkStsCalibration,
    StsDataRecorder,
    load_sts_calibration_from_path,
)

from sglang_dspark.calibration import (
    StsData,
    add_arguments,
    apply_temperatures,
    brier_score,
    calibrate,
    evaluate,
    expected_calibration_error,
    fit,
    load_data,
    load_sts_data,
    roc_auc,
    run,
    save_sts_data,
)

torch.set_num_threads(1)

OVERCONFIDENCE = 2.5


def synthetic_blocks(n: int, gamma: int, seed: int = 0, s: float = OVERCONFIDENCE):
    """A known model: true conditional survival p_k = sigmoid(z_k); the head reports s * z_k.

    Returns (logits, true p, number of accepted drafts per block).
    """
    g = torch.Generator().manual_seed(seed)
    mu = torch.linspace(1.5, 0.5, gamma, dtype=torch.float64)
    z = mu + 1.2 * torch.randn(n, gamma, generator=g, dtype=torch.float64)
    p = torch.sigmoid(z)
    accept = torch.rand(n, gamma, generator=g, dtype=torch.float64) < p
    n_accepted = torch.cumprod(accept.long(), 1).sum(1)
    return z * s, p, n_accepted


def blocks_to_data(logits, n_accepted, verified=None) -> StsData:
    """Evaluator-style arrays; `verified` [n] truncates a block's verification."""
    gamma = logits.shape[1]
    pos = torch.arange(gamma)[None, :]
    limit = n_accepted if verified is None else torch.minimum(n_accepted, verified)
    valid = pos <= limit[:, None]
    if verified is not None:
        valid &= pos < verified[:, None]
    accepted = valid & (pos < n_accepted[:, None])
    return StsData(logits, accepted, valid, verified)


# ---------------------------------------------------------------------------------------------
# The fitter recovers a known overconfidence


def test_fit_recovers_known_temperature_and_calibrates_heldout():
    logits, _, n_acc = synthetic_blocks(100_000, 5)
    result = calibrate(blocks_to_data(logits, n_acc), heldout_fraction=0.3)
    temps = result.calibration.temperatures
    assert temps == pytest.approx([OVERCONFIDENCE] * 5, abs=0.3), temps
    held = result.metrics["heldout"]
    assert held["num_samples"] == 30_000
    assert held["mean_cumulative_ece_after"] < 0.02
    assert held["mean_cumulative_ece_before"] > 0.08
    for p in held["positions"]:
        # Temperature scaling is order preserving: the head's AUC per position is unchanged.
        assert p["conditional"]["after"]["auc"] == pytest.approx(
            p["conditional"]["before"]["auc"], abs=1e-12
        )
        assert p["cumulative"]["after"]["brier"] < p["cumulative"]["before"]["brier"]
    assert result.calibration.ece_after == [
        p["cumulative"]["after"]["ece"] for p in held["positions"]
    ]


def test_fit_on_truncated_verification_uses_blocks_whose_window_covered_k():
    """A scheduler verified only part of each block: a_k is fitted on the blocks whose verify
    window reached k, whatever their outcome (the window was chosen before the outcome)."""
    logits, _, n_acc = synthetic_blocks(60_000, 4, seed=1)
    verified = torch.randint(1, 5, (60_000,), generator=torch.Generator().manual_seed(2))
    data = blocks_to_data(logits, n_acc, verified)
    assert fit(data) == pytest.approx([OVERCONFIDENCE] * 4, abs=0.35)
    # Without the window, a block that failed early would count at every later k while a
    # surviving one counts only up to its window: an outcome-dependent sample. Even the TRUE
    # survival then looks miscalibrated at the last position, while it is calibrated on the
    # blocks whose window covered k.
    label, in_window = data.cumulative_labels()
    failed = data.valid & ~data.accepted
    outcome_rows = data.valid | (torch.cumsum(failed.long(), 1) > 0)
    true_a = torch.cumprod(apply_temperatures(logits, [OVERCONFIDENCE] * 4), 1)
    k = 3
    assert expected_calibration_error(true_a[in_window[:, k], k], label[in_window[:, k], k]) < 0.02
    assert (
        expected_calibration_error(true_a[outcome_rows[:, k], k], label[outcome_rows[:, k], k])
        > 0.05
    )
    with pytest.raises(ValueError, match="verified only partly"):
        StsData(logits, data.accepted, data.valid)  # refused without the windows
    # Counting unverified drafts as rejections (SGLang's collector in compact mode) biases T.
    as_rejections = blocks_to_data(logits, torch.minimum(n_acc, verified))
    assert max(abs(t - OVERCONFIDENCE) for t in fit(as_rejections)) > 0.5
    with pytest.raises(ValueError, match="earlier position"):
        StsData(logits, data.accepted, torch.ones_like(data.valid))


def test_fit_matches_sglang_fitter_on_collector_data():
    """Without the refinement pass our fit is SGLang's `dspark_sts_fit` on the same data."""
    from sglang.benchmark.dspark_sts_fit import default_temperature_grid, fit_sts_temperatures

    logits, _, n_acc = synthetic_blocks(20_000, 4, seed=3)
    prefix = (torch.arange(4)[None, :] < n_acc[:, None]).float()
    theirs = fit_sts_temperatures(
        logits=logits, prefix_mask=prefix, grid=default_temperature_grid()
    )
    ours = fit(blocks_to_data(logits, n_acc), refine=False)
    assert ours == theirs["temperatures"]
    ece = evaluate(ours, blocks_to_data(logits, n_acc))
    assert [p["cumulative"]["after"]["ece"] for p in ece["positions"]] == pytest.approx(
        theirs["ece_after"], abs=1e-9
    )


# ---------------------------------------------------------------------------------------------
# Metrics against hand-computed values


def test_ece_hand_computed():
    p = torch.tensor([0.1, 0.2, 0.8, 0.9])
    y = torch.tensor([0, 1, 1, 1])
    # 2 bins: {0.1, 0.2}: |0.15 - 0.5| * 2/4; {0.8, 0.9}: |0.85 - 1| * 2/4
    assert expected_calibration_error(p, y, num_bins=2) == pytest.approx(0.175 + 0.075)
    assert expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([1, 0])) == 0.0
    # 15 bins, one row per bin edge case: p = 1/15 falls in bin 1, not bin 0
    assert expected_calibration_error(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 0.0
    assert expected_calibration_error(torch.tensor([0.3]), torch.tensor([1])) == pytest.approx(0.7)


def test_ece_matches_sglang():
    from sglang.benchmark.dspark_sts_fit import expected_calibration_error as sglang_ece

    g = torch.Generator().manual_seed(0)
    p = torch.rand(5000, generator=g, dtype=torch.float64) * 0.98 + 0.01
    y = torch.rand(5000, generator=g, dtype=torch.float64) < p**1.5
    assert expected_calibration_error(p, y) == pytest.approx(
        sglang_ece(probs=p, targets=y, num_bins=15), abs=1e-12
    )


def test_auc_hand_computed():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    # ties count one half: pos {0.5, 0.9} vs neg {0.2, 0.5} -> (1 + 0.5 + 1 + 1) / 4
    assert roc_auc(torch.tensor([0.2, 0.5, 0.5, 0.9]), torch.tensor([0, 1, 0, 1])) == 0.875
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5
    assert roc_auc(torch.tensor([0.9, 0.1]), torch.tensor([0, 1])) == 0.0
    assert np.isnan(roc_auc(torch.tensor([0.2, 0.3]), torch.tensor([1, 1])))


def test_brier_hand_computed():
    assert brier_score(torch.tensor([0.1, 0.8]), torch.tensor([0, 1])) == pytest.approx(0.025)
    assert brier_score(torch.tensor([1.0, 0.0]), torch.tensor([1, 0])) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-40, 40), st.booleans()), min_size=2, max_size=40))
def test_auc_is_the_pairwise_probability(rows):
    s = torch.tensor([r[0] / 8 for r in rows], dtype=torch.float64)
    y = torch.tensor([r[1] for r in rows])
    pos, neg = s[y].tolist(), s[~y].tolist()
    if not pos or not neg:
        assert np.isnan(roc_auc(s, y))
        return
    pairs = [1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg)]
    assert roc_auc(s, y) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-40, 40), st.booleans()), min_size=2, max_size=40),
    st.floats(0.1, 10.0),
)
def test_temperature_scaling_never_changes_auc(rows, temperature):
    z = torch.tensor([[r[0] / 8] for r in rows], dtype=torch.float64)
    y = torch.tensor([[r[1]] for r in rows])
    data = StsData(z, y, torch.ones_like(y))
    before = evaluate([1.0], data)["positions"][0]["conditional"]
    after = evaluate([temperature], data)["positions"][0]["conditional"]
    b, a = before["before"]["auc"], after["after"]["auc"]
    assert (np.isnan(b) and np.isnan(a)) or a == b


def test_cumulative_labels():
    data = StsData(
        torch.zeros(4, 3, dtype=torch.float64),
        accepted=torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]).bool(),
        valid=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]]).bool(),
        verified=torch.tensor([2, 3, 3, 1]),
    )
    label, in_window = data.cumulative_labels()
    # row 0: window 2, both accepted, position 3 never verified -> not used at k = 3
    # row 1: rejected at 1 with a full window -> every later prefix fails
    # row 2: rejected at 2
    # row 3: rejected at 1, window 1 -> used only at k = 1 (independent of its outcome)
    assert label.int().tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert in_window.int().tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="beyond"):
        StsData(data.logits, data.accepted, data.valid, torch.tensor([1, 3, 3, 1]))


# ---------------------------------------------------------------------------------------------
# Files: ours, SGLang's collector shards, SGLang's calibration JSON


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_sts_data_roundtrip(tmp_path, suffix):
    logits, _, n_acc = synthetic_blocks(50, 3)
    path = tmp_path / f"sts{suffix}"
    data = blocks_to_data(logits, n_acc)
    save_sts_data(path, data.logits.numpy(), data.accepted.int().numpy(), data.valid.tolist())
    back = load_sts_data(path)
    assert torch.equal(back.logits, data.logits) and back.verified is None
    assert torch.equal(back.accepted, data.accepted) and torch.equal(back.valid, data.valid)
    keys = sorted(np.load(path).files) if suffix == ".npz" else sorted(json.loads(path.read_text()))
    assert keys == ["accepted", "logits", "valid"]
    # truncated verification carries the window
    data = blocks_to_data(logits, n_acc, torch.full((50,), 2))
    save_sts_data(path, data.logits, data.accepted, data.valid, data.verified.tolist())
    back = load_sts_data(path)
    assert torch.equal(back.verified, data.verified) and torch.equal(back.valid, data.valid)


def test_rejects_bad_data(tmp_path):
    with pytest.raises(ValueError, match="one shape"):
        StsData(torch.zeros(2, 3), torch.zeros(2, 3).bool(), torch.zeros(2, 2).bool())
    with pytest.raises(ValueError, match="must end in"):
        save_sts_data(tmp_path / "x.csv", [[0.0]], [[1]], [[1]])
    (tmp_path / "bad.json").write_text(json.dumps({"logits": [[0.0]]}))
    with pytest.raises(ValueError, match="lacks the arrays"):
        load_sts_data(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="no STS data file"):
        load_data(str(tmp_path / "none.*.pt"))


def _record_collector_shards(stem, logits, n_accepted, steps: int, flush_every: int):
    """Shards written by SGLang's own recorder, as the server does under
    SGLANG_DSPARK_STS_COLLECT_PATH (one `record` per decode step)."""
    rec = StsDataRecorder(path_stem=str(stem), gamma=logits.shape[1], flush_every=flush_every)
    for rows in torch.arange(logits.shape[0]).chunk(steps):
        rec.record(confidence_raw=logits[rows].float(), num_correct_drafts=n_accepted[rows])
    rec.flush()


def test_reads_sglang_collector_shards(tmp_path):
    logits, _, n_acc = synthetic_blocks(40_000, 4, seed=5)
    _record_collector_shards(tmp_path / "sts", logits, n_acc, steps=40, flush_every=16)
    shards = sorted(tmp_path.glob("sts.*.pt"))
    assert len(shards) == 3
    data = load_data(str(tmp_path / "sts.*.pt"))
    assert data.num_samples == 40_000 and data.gamma == 4
    # shards are concatenated in sorted-name order; match rows by content
    want = blocks_to_data(logits.float().double(), n_acc)
    order_ours = torch.argsort(data.logits[:, 0])
    order_want = torch.argsort(want.logits[:, 0])
    assert torch.equal(data.logits[order_ours], want.logits[order_want])
    assert torch.equal(data.accepted[order_ours], want.accepted[order_want])
    assert torch.equal(data.valid[order_ours], want.valid[order_want])
    assert fit(data) == pytest.approx([OVERCONFIDENCE] * 4, abs=0.35)


def test_collector_shard_is_loaded_without_unpickling(tmp_path):
    path = tmp_path / "evil.0.pt"  # any non-tensor object would run code when unpickled
    torch.save(
        {
            "logits": torch.zeros(1, 2),
            "prefix_mask": torch.zeros(1, 2),
            "x": argparse.Namespace(a=1),
        },
        path,
    )
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|global"):
        load_sts_data(path)


def test_cli_writes_sglang_calibration_metrics_and_plot(tmp_path, capsys):
    logits, _, n_acc = synthetic_blocks(30_000, 3, seed=7)
    data = blocks_to_data(logits, n_acc)
    save_sts_data(tmp_path / "eval.npz", data.logits, data.accepted, data.valid)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--data",
            str(tmp_path / "eval.npz"),
            "--heldout-fraction",
            "0.3",
            "--out",
            str(tmp_path / "sts.json"),
            "--plot",
            str(tmp_path / "reliability.png"),
        ]
    )
    assert run(args) == 0
    calib = load_sts_calibration_from_path(str(tmp_path / "sts.json"))  # SGLang's loader
    assert isinstance(calib, DSparkStsCalibration)
    assert len(calib.temperatures) == 3 and all(t > 0 for t in calib.temperatures)
    assert calib.num_samples == 21_000
    assert len(calib.ece_before) == len(calib.ece_after) == 3
    assert max(calib.ece_after) < 0.03 < min(calib.ece_before)
    assert set(json.loads((tmp_path / "sts.json").read_text())) == {
        "temperatures",
        "dataset",
        "num_samples",
        "ece_before",
        "ece_after",
    }
    metrics = json.loads((tmp_path / "sts.metrics.json").read_text())
    assert metrics["heldout"]["temperatures"] == calib.temperatures
    assert metrics["heldout"]["num_bins"] == 15
    assert (tmp_path / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean ECE of a_k" in capsys.readouterr().out


def test_cli_accepts_collector_glob_without_heldout(tmp_path):
    logits, _, n_acc = synthetic_blocks(5_000, 2, seed=8)
    _record_collector_shards(tmp_path / "c", logits, n_acc, steps=10, flush_every=4)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "sts.json"
    assert (
        run(
            parser.parse_args(
                [
                    "--data",
                    str(tmp_path / "c.*.pt"),
                    "--out",
                    str(out),
                    "--heldout-fraction",
                    "0",
                    "--gamma",
                    "2",
                ]
            )
        )
        == 0
    )
    calib = load_sts_calibration_from_path(str(out))
    assert calib.num_samples == 5_000 and len(calib.temperatures) == 2
    with pytest.raises(ValueError, match="gamma=2"):
        run(
            parser.parse_args(
                ["--data", str(tmp_path / "c.*.pt"), "--out", str(out), "--gamma", "3"]
            )
        )


def test_plugin_recorder_keeps_every_step_per_rank_and_the_verify_window(tmp_path):
    """The plugin's recorder (dspark_sts_recorder): a rank-suffixed open shard rewritten on every
    flush (a finished request), closed after flush_every steps; `verified` leaves positions past
    a trimmed window out instead of counting them as rejections."""
    from sglang_dspark.plugin.sts_collect import StsRecorder

    rec = StsRecorder(str(tmp_path / "sts"), gamma=4, rank=1, flush_every=3)
    steps = [  # (raw logits [bs, 4], accepted drafts [bs], drafts verified [bs])
        (torch.zeros(2, 4), torch.tensor([4, 1]), torch.tensor([4, 4])),
        (torch.ones(1, 4), torch.tensor([2]), torch.tensor([2])),  # all verified accepted
        (torch.ones(1, 4), torch.tensor([0]), torch.tensor([3])),
        (torch.zeros(1, 4), torch.tensor([1]), torch.tensor([1])),
    ]
    for i, step in enumerate(steps[:2]):
        rec.record(*step)
        rec.flush()  # a request finished: the open shard is complete on disk
        assert torch.load(tmp_path / "sts.rank1.0.pt")["logits"].shape[0] == (2 if i == 0 else 3)
    for step in steps[2:]:
        rec.record(*step)  # the 3rd step closes shard 0; the 4th opens shard 1
    rec.flush()
    assert sorted(p.name for p in tmp_path.glob("sts.*")) == ["sts.rank1.0.pt", "sts.rank1.1.pt"]
    data = load_data(str(tmp_path / "sts.rank1.*.pt"))
    assert data.num_samples == 5
    assert data.verified.tolist() == [4, 4, 2, 3, 1]
    # row 2: drafts 1-2 accepted in a window of 2: positions 3-4 are unknown, not rejections
    assert data.valid[2].tolist() == [True, True, False, False]
    assert data.accepted[2, :2].tolist() == [True, True]
    # row 3: draft 1 rejected in a window of 3: only position 1 is labelled
    assert data.valid[3].tolist() == [True, False, False, False]
    assert data.accepted[3, 0].item() is False
    assert data.valid[0].tolist() == [True] * 4 and data.accepted[0].tolist() == [True] * 4


def test_cli_heldout_data_from_other_prompts(tmp_path, capsys):
    """--heldout-data: fit on every row of --data, report ECE on the other file's rows."""
    for name, seed, n in (("fit", 11, 20_000), ("held", 12, 8_000)):
        logits, _, n_acc = synthetic_blocks(n, 3, seed=seed)
        d = blocks_to_data(logits, n_acc)
        save_sts_data(tmp_path / f"{name}.npz", d.logits, d.accepted, d.valid)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--data", str(tmp_path / "fit.npz"), "--heldout-data", str(tmp_path / "held.npz"),
        "--out", str(tmp_path / "sts.json"),
    ])  # fmt: skip
    assert run(args) == 0
    calib = load_sts_calibration_from_path(str(tmp_path / "sts.json"))
    assert calib.num_samples == 20_000  # every fitting row
    metrics = json.loads((tmp_path / "sts.metrics.json").read_text())
    assert metrics["heldout"]["num_samples"] == 8_000
    assert (
        metrics["heldout"]["mean_cumulative_ece_after"]
        < metrics["heldout"]["mean_cumulative_ece_before"]
    )
    assert "STS on held-out rows (8000)" in capsys.readouterr().out


def test_cli_baseline_is_scored_on_the_same_heldout_rows(tmp_path, capsys):
    """--baseline OLD: the old file's temperatures on the same held-out rows beside the new fit
    (an identity file, T = 1, scores exactly the "before" column); a file for another block size
    or a broken file is refused with what was wrong."""
    for name, seed, n in (("fit", 21, 20_000), ("held", 22, 8_000)):
        logits, _, n_acc = synthetic_blocks(n, 3, seed=seed)
        d = blocks_to_data(logits, n_acc)
        save_sts_data(tmp_path / f"{name}.npz", d.logits, d.accepted, d.valid)
    identity = tmp_path / "identity.json"
    identity.write_text(DSparkStsCalibration(temperatures=[1.0, 1.0, 1.0]).to_json())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--data", str(tmp_path / "fit.npz"), "--heldout-data", str(tmp_path / "held.npz"),
            "--out", str(tmp_path / "sts.json")]  # fmt: skip
    assert run(parser.parse_args([*argv, "--baseline", str(identity)])) == 0
    metrics = json.loads((tmp_path / "sts.metrics.json").read_text())
    base, held = metrics["baseline"], metrics["heldout"]
    assert base["path"] == str(identity) and base["num_samples"] == 8_000
    assert base["mean_cumulative_ece_after"] == pytest.approx(held["mean_cumulative_ece_before"])
    assert held["mean_cumulative_ece_after"] < base["mean_cumulative_ece_after"]
    assert f"baseline {identity} on the same rows" in capsys.readouterr().out

    other = tmp_path / "gamma7.json"
    other.write_text(DSparkStsCalibration(temperatures=[1.0] * 7).to_json())
    with pytest.raises(ValueError, match="7 temperatures but the data has gamma=3"):
        run(parser.parse_args([*argv, "--baseline", str(other)]))
    broken = tmp_path / "broken.json"
    broken.write_text('{"temperatures": [1.0, -2.0, 1.0]')
    with pytest.raises(ValueError, match="is not an SGLang STS file"):
        run(parser.parse_args([*argv, "--baseline", str(broken)]))
    with pytest.raises(ValueError, match="no such file"):
        run(parser.parse_args([*argv, "--baseline", str(tmp_path / "missing.json")]))

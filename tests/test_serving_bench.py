"""benchmarks/serving.py's instrument without servers: interleaved rounds, the plain arm as
contamination control (a departing cell is re-run for every arm), compact CSVs, intervals,
variant arms and paired ratios."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(monkeypatch) -> ModuleType:
    """The script as a module (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("serving", REPO / "benchmarks" / "serving.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "serving", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def bench(monkeypatch):
    mod = load(monkeypatch)

    class Server:
        stopped = False

        def stop(self):
            Server.stopped = True

    def start_servers(arms, dtype, log_dir):
        Server.arms = dict(arms)
        return {n: Server() for n in arms}

    monkeypatch.setattr(mod, "start_servers", start_servers)
    return mod, Server


SPEED = {"plain": 10.0, "mtp1": 12.0, "dspark-sync": 14.0, "dspark-static": 11.0, "off": 7.0}


def fake_stage(calls, contaminated):
    def run_stage(server, name, users, args, out):
        attempt = int(out.name.rsplit("-a", 1)[1])
        r = int(out.name.split("-r")[1].split("-")[0])
        calls.append((name, users, r, attempt))
        per_user = SPEED[name] / (1 + users / 8) * (1 + 0.01 * r)
        if (users, r, attempt) == contaminated:  # the machine was busy during this cell
            per_user *= 0.6
        y = users * per_user
        row = {"users": users, "requests": 4, "failures": 0, "missing_usage": 0,
               "completed_in_window": 4, "output_tokens": 4 * 64,
               "user_tok_s_e2e_mean": per_user * 0.9, "user_tok_s_mean": per_user,
               "output_tok_s_same": y, "output_tok_s_total": y * 1.01, "ttft_p50_s": 0.5,
               "accept_len": None if name == "plain" else 1.3, "verify_len_mean": None}  # fmt: skip
        samples = [
            {
                "start": 5.0 + i,
                "end": 11.0 + i,
                "first_token": 5.5 + i,
                "ok": True,
                "output_tokens": 64,
                "accept_len": row["accept_len"],
            }
            for i in range(4)
        ]
        samples.append(
            {"start": 0.5, "end": 3.0, "first_token": 1.0, "ok": True, "output_tokens": 64}
        )
        return {"label": name, "server": {"speculative_algorithm": None if name == "plain" else "X"},
                "stages": [row], "samples": samples,
                "stage_windows": [{"run_start": 0.0, "run_end": 40.0, "warmup_s": 2.0}]}  # fmt: skip

    return run_stage


def test_a_cell_whose_plain_arm_departs_is_run_again_for_every_arm(bench, monkeypatch, tmp_path):
    mod, server = bench
    calls: list = []
    monkeypatch.setattr(mod, "run_stage", fake_stage(calls, contaminated=(4, 1, 0)))
    out = tmp_path / "out"
    argv = [
        "--out",
        str(out),
        "--arms",
        "plain,mtp1,dspark-sync",
        "--users",
        "1,4",
        "--rounds",
        "3",
    ]
    assert mod.main(argv) == 0
    assert server.stopped
    # 2 levels x 3 rounds x 3 arms, plus the contaminated cell again for all three arms.
    assert len(calls) == 18 + 3
    assert sorted(c[0] for c in calls if c[3] == 1) == ["dspark-sync", "mtp1", "plain"]
    assert {c[1:3] for c in calls if c[3] == 1} == {(4, 1)}
    report = (out / "report.md").read_text()
    assert "c=4 round 1: plain -40% off its other rounds; cell re-run (attempt 1)" in report
    stages = list(csv.DictReader((out / "stages.csv").open()))
    assert [s["order"] for s in stages] == [str(i) for i in range(21)]
    replaced = [s for s in stages if s["kept"] == "0"]
    assert len(replaced) == 3 and {(s["users"], s["round"], s["attempt"]) for s in replaced} == {
        ("4", "1", "0")
    }
    samples = list(csv.DictReader((out / "samples.csv").open()))
    assert len(samples) == 21 * 4  # the warm-up request is not a measured one
    assert {s["ttft_s"] for s in samples} == {"0.5"} and samples[0]["start_s"] == "3.0"
    # The merged summary keeps the re-run, not the contaminated stage, and every round's value.
    plain = json.loads((out / "arms" / "plain" / "sla_summary.json").read_text())
    row4 = next(r for r in plain["stages"] if r["users"] == 4)
    assert row4["rounds"]["output_tok_s_same"] == pytest.approx(
        [4 * 10 / 1.5 * (1 + 0.01 * r) for r in range(3)]
    )
    assert "samples" not in plain
    pts = {
        (a["label"], p["users"]): p
        for a in json.loads((out / "pareto.json").read_text())["arms"]
        for p in a["points"]
    }
    assert pts[("plain", 4)]["rounds"] == 3 and pts[("plain", 4)]["x"] == pytest.approx(
        row4["user_tok_s_e2e_mean"]
    )
    lo, hi = pts[("dspark-sync", 1)]["y_ci"]
    assert lo < pts[("dspark-sync", 1)]["y"] < hi
    assert (out / "pareto.png").stat().st_size and (out / "no-ttft" / "pareto.png").stat().st_size
    assert "round by round (3 of 3 overlap)" in report


def test_a_cell_that_stays_off_is_kept_and_reported(bench, monkeypatch, tmp_path):
    mod, _ = bench
    calls: list = []
    contaminated = {(1, 0, 0), (1, 0, 1)}
    run = fake_stage(calls, contaminated=None)

    def always_busy(server, name, users, args, out):
        rep = run(server, name, users, args, out)
        if calls[-1][1:] in contaminated:
            rep["stages"][0]["output_tok_s_same"] *= 1.5
        return rep

    monkeypatch.setattr(mod, "run_stage", always_busy)
    out = tmp_path / "out"
    assert (
        mod.main(["--out", str(out), "--arms", "plain,mtp1", "--users", "1", "--rounds", "3"]) == 0
    )
    report = (out / "report.md").read_text()
    assert "c=1 round 0: plain +48% off its other rounds; cell re-run (attempt 1)" in report
    assert "c=1 round 0: plain still +48% off its other rounds after re-runs; kept" in report
    # 1.5 x round 0 against the median of rounds 1 and 2 (speeds x1.01, x1.02); rounds 1 and 2
    # also sit off a median that includes round 0, but only the worst round is re-run.
    assert len(calls) == 3 * 2 + 2


def test_departure_is_measured_against_the_other_rounds(monkeypatch):
    mod = load(monkeypatch)
    assert mod.departs({0: 10.0, 1: 10.5, 2: 8.0}, 2, 0.1) == pytest.approx(8.0 / 10.25 - 1)
    assert mod.departs({0: 10.0, 1: 10.5, 2: 9.5}, 2, 0.1) is None
    assert mod.departs({0: 10.0, 1: None, 2: 9.5}, 1, 0.1) is None


def test_a_variant_is_its_base_arm_with_one_change_and_ratios_are_paired(
    bench, monkeypatch, tmp_path
):
    mod, server = bench
    calls: list = []
    monkeypatch.setattr(mod, "run_stage", fake_stage(calls, contaminated=None))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--arms", "dspark-static,dspark-sync", "--users", "1,4",
            "--rounds", "3", "--ratio-to", "dspark-static,off",
            "--variant", "off=dspark-sync:SGLANG_DSPARK_DISABLE_HOOKS=a,b:draft=/tmp/d"]  # fmt: skip
    assert mod.main(argv) == 0
    off = server.arms["off"]
    assert list(server.arms) == ["dspark-static", "dspark-sync", "off"]
    assert (off.kind, off.scheduler, off.draft) == ("dspark", "sync", Path("/tmp/d"))
    assert (
        off.env == {"SGLANG_DSPARK_DISABLE_HOOKS": "a,b"} and server.arms["dspark-sync"].env == {}
    )
    assert len(calls) == 2 * 3 * 3
    report = (out / "report.md").read_text()
    assert "## Against dspark-static, round by round" in report
    # the synthetic speeds: 14 / 11 for sync and 7 / 11 for off, the same in every round
    assert "| dspark-sync | 4 | 1.273 [1.273, 1.273] |" in report
    assert "| off | 1 | 0.636 [0.636, 0.636] |" in report
    # a second --ratio-to arm: its own table, the same rounds paired (11 / 7 at one user)
    against_off = report.split("## Against off, round by round")[1].split("## Contamination")[0]
    assert "| dspark-static | 1 | 1.571 [1.571, 1.571] |" in against_off


def test_every_other_speculative_arm_is_compared_with_the_baseline(bench, monkeypatch, tmp_path):
    mod, _ = bench
    monkeypatch.setattr(mod, "run_stage", fake_stage([], contaminated=None))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--arms", "plain,mtp1,dspark-sync,dspark-static", "--users",
            "1,4", "--rounds", "3", "--arm", "dspark-sync", "--baseline", "mtp1",
            "--variant", "off=dspark-sync:SGLANG_DSPARK_PLAIN_ROUNDS=off"]  # fmt: skip
    assert mod.main(argv) == 0
    report = (out / "report.md").read_text()
    main_view, others = report.split("## Every other speculative arm against mtp1")
    assert "dspark-sync vs mtp1: throughput at matched tok/s/user" in main_view
    assert "dspark-static vs mtp1" not in main_view and "dspark-sync vs mtp1" not in others
    # synthetic speeds: x and y scale with the arm's speed (mtp1 12, static 11, off 7): the
    # static frontier overlaps mtp1's, off's (every point slower) does not; both x views
    for label, overlap in (("dspark-static", True), ("off", False)):
        lines = [ln for ln in others.splitlines() if ln.startswith(f"{label} vs mtp1: throughput")]
        assert len(lines) == 2, lines
        for line in lines:
            assert ("at baseline points: c=4: 0." in line) is overlap, line
            assert ("frontiers do not overlap" in line) is not overlap, line
    assert "plain vs" not in others


def test_a_variant_must_name_a_known_arm_and_a_new_label(monkeypatch):
    mod = load(monkeypatch)
    for bad, why in [("x=nope:A=1", "BASE one of"), ("mtp1=dspark-sync:A=1", "is taken"),
                     ("x=dspark-sync", "BASE one of"), ("x=dspark-sync:A", "not KEY=VALUE"),
                     ("x=plain:draft=/d", "no drafter")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            mod.parse_variant(bad, mod.ARMS)
    label, arm = mod.parse_variant("ft=mtp1:draft=/d", mod.ARMS)
    assert label == "ft" and arm.kind == "mtp1" and arm.draft == Path("/d")

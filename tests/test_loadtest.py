"""The SLA load test (loadtest/sla.py + sglang_dspark.measurement.loadmetrics) and the Pareto plots.

The maths runs on synthetic streams and samples with hand-computed numbers; Locust runs only in
subprocesses (importing it here would monkey-patch this process with gevent): against a fake
server for the usage rules, and against a real embedded SGLang server for sane numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_dspark.measurement import loadmetrics as lm
from sglang_dspark.measurement import pareto

REPO = Path(__file__).resolve().parents[1]
SLA = REPO / "loadtest" / "sla.py"
LOCUST = Path(sys.executable).parent / "locust"


def sse(*events: dict, done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def content(text: str, tokens_so_far: int | None = None) -> dict:
    event: dict = {"choices": [{"index": 0, "delta": {"content": text}}]}
    if tokens_so_far is not None:
        event["usage"] = {"completion_tokens": tokens_so_far}
    return event


def usage(tokens: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}


def window(index=0, run_start=0.0, run_end=10.0, warmup=0.0, users=1) -> lm.StageWindow:
    return lm.StageWindow(index, users, run_start, run_end, warmup)


def sample(start, first, end, tokens, ok=True, **kw) -> lm.Sample:
    return lm.Sample(
        stage=0, start=start, end=end, ok=ok, first_token=first, output_tokens=tokens, **kw
    )


# ------------------------------------------------------------------------------------------
# per request: tokens from usage, never from chunks


def test_multi_token_chunks_count_the_servers_tokens_not_the_chunks():
    # Three chunks of several tokens each (speculative decoding), usage only at the end.
    stream = sse(
        {"choices": [{"delta": {"role": "assistant"}}]},
        content("The answer"),
        content(" is forty"),
        content(" two."),
        usage(7),
    )
    parser = lm.StreamParser(stage=0, start=1.0)
    half = len(stream) // 2  # a line split across two reads
    parser.feed(stream[:half], 1.5)
    parser.feed(stream[half:], 4.5)
    s = parser.finish(4.5)
    assert s.ok and s.output_tokens == 7 and s.content_chunks == 3
    assert s.first_token == 1.5 and s.ttft == pytest.approx(0.5)
    assert s.tpot == pytest.approx((4.5 - 1.5) / 6)  # (e2e - ttft) / (tokens - 1)
    assert s.user_tok_s == pytest.approx(2.0)
    assert s.timeline is None and s.itl() == []  # no per-chunk usage: ITL not guessed


def test_continuous_usage_gives_the_token_timeline_and_itl():
    parser = lm.StreamParser(stage=0, start=0.0)
    parser.feed(sse(content("a b c", 3), done=False), 1.0)  # 3 tokens in the first chunk
    parser.feed(sse(content("d e", 5), done=False), 2.0)  # 2 tokens 1 s later
    parser.feed(sse(content("f", 6), done=False), 2.5)
    parser.feed(sse(usage(7)), 2.6)  # e.g. the EOS token, not streamed as text
    s = parser.finish(2.6)
    assert s.output_tokens == 7
    assert s.timeline == [(1.0, 3), (2.0, 2), (2.5, 1), (2.6, 1)]
    assert s.itl() == pytest.approx([0.5, 0.5, 0.5, 0.1])
    assert s.tokens_in(0.0, 2.0) == 3 and s.tokens_in(2.0, 3.0) == 4


def test_sglang_spec_details_are_recorded_per_request():
    ext = {
        "choices": [],
        "sglext": {
            "spec_tokens_details": {
                "spec_accept_length": 3.5,
                "spec_cap_length": 6.25,
                "spec_verify_ct": 4,
            }
        },
    }
    parser = lm.StreamParser(stage=0, start=0.0)
    parser.feed(sse(content("x" * 14), ext, usage(14)), 1.0)
    s = parser.finish(1.0)
    assert (s.accept_len, s.verify_len, s.verify_steps) == (3.5, 6.25, 4)
    row = lm.summarize_stage([s], window(run_end=5.0), lm.Slo())
    assert row.accept_len == pytest.approx(14 / 4) and row.verify_len_mean == 6.25


def test_missing_usage_is_counted_not_guessed_from_chunks():
    parser = lm.StreamParser(stage=0, start=0.0)
    parser.feed(sse(content("one"), content(" two"), content(" three")), 1.0)
    s = parser.finish(2.0)
    assert s.ok and s.output_tokens is None and s.content_chunks == 3
    row = lm.summarize_stage([s], window(), lm.Slo())
    assert row.requests == 1 and row.failures == 0 and row.missing_usage == 1
    assert row.output_tokens == 0 and row.output_tok_s_total == 0.0
    assert row.user_tok_s_p50 is None and row.tpot_p50_s is None
    assert row.ttft_p50_s == pytest.approx(1.0)  # measured without tokens
    problems = lm.run_problems([row], lm.Slo())
    assert len(problems) == 1 and "no usage.completion_tokens" in problems[0]


def test_errors_and_empty_streams_are_failures():
    parser = lm.StreamParser(stage=0, start=0.0)
    parser.feed(sse({"error": {"message": "context too long"}}), 0.2)
    assert parser.finish(0.2).error == "context too long"
    s = lm.StreamParser(stage=0, start=0.0).finish(0.1)
    assert not s.ok and "without any generated text" in s.error
    s = lm.StreamParser(stage=0, start=0.0).finish(0.1, error="ConnectionError: reset")
    row = lm.summarize_stage([s], window(), lm.Slo())
    assert row.failures == 1 and row.requests == 1
    assert "1 of 1 requests failed" in lm.run_problems([row], lm.Slo())[0]


# ------------------------------------------------------------------------------------------
# per stage: windows, straddling requests, empty stages, SLOs


def test_a_request_straddling_two_stages_is_split_by_time_overlap():
    # 21 tokens: the first at t=2, 20 more uniformly over (2, 12] (2 tokens/s).
    s = sample(start=1.5, first=2.0, end=12.0, tokens=21)
    a = window(index=0, run_start=0.0, run_end=6.0, warmup=1.0)  # window [1, 6)
    b = window(index=1, run_start=6.0, run_end=16.0)  # window [6, 16)
    ra, rb = lm.summarize_stage([s], a, lm.Slo()), lm.summarize_stage([s], b, lm.Slo())
    assert ra.output_tok_s_total == pytest.approx((1 + 20 * 4 / 10) / 5)  # 9 tokens in 5 s
    assert rb.output_tok_s_total == pytest.approx((20 * 6 / 10) / 10)  # 12 tokens in 10 s
    assert ra.output_tok_s_total * ra.window_s + rb.output_tok_s_total * rb.window_s == (
        pytest.approx(21)
    )
    # Latencies belong to the stage it started in, the completion to the one it ended in.
    assert (ra.requests, ra.completed_in_window, ra.requests_per_s) == (1, 0, 0.0)
    assert (rb.requests, rb.completed_in_window, rb.requests_per_s) == (0, 1, 0.1)
    assert ra.user_tok_s_p50 == pytest.approx(2.0) and ra.ttft_p50_s == pytest.approx(0.5)
    assert ra.e2e_p50_s == pytest.approx(10.5) and rb.user_tok_s_p50 is None


def test_straddling_with_a_timeline_counts_tokens_where_they_arrived():
    s = sample(start=1.5, first=2.0, end=8.0, tokens=21, timeline=[(2.0, 1), (4.0, 10), (8.0, 10)])
    a = window(run_start=0.0, run_end=6.0, warmup=1.0)
    b = window(index=1, run_start=6.0, run_end=16.0)
    assert lm.summarize_stage([s], a, lm.Slo()).output_tok_s_total == pytest.approx(11 / 5)
    assert lm.summarize_stage([s], b, lm.Slo()).output_tok_s_total == pytest.approx(10 / 10)


def test_warmup_is_excluded_from_the_window():
    early = sample(start=0.0, first=0.5, end=0.9, tokens=5)  # entirely inside the warm-up
    late = sample(start=3.0, first=3.5, end=4.5, tokens=11)
    row = lm.summarize_stage([early, late], window(run_end=10.0, warmup=2.0), lm.Slo())
    assert row.window_s == 8.0 and row.requests == 1 and row.completed_in_window == 1
    assert row.output_tok_s_total == pytest.approx(11 / 8)
    assert row.user_tok_s_mean == pytest.approx(10.0)


def test_x_and_y_of_a_point_come_from_the_same_requests():
    # Two users in a closed loop; the window [0, 10). Started inside it: a (20 tokens in 4 s,
    # TTFT 1 s), b (10 tokens in 2 s, TTFT 0.5 s); c started before the window: only its
    # window tokens count in output_tok_s_total, and it is in neither per-user speed.
    a = sample(start=1.0, first=2.0, end=5.0, tokens=20)
    b = sample(start=6.0, first=6.5, end=8.0, tokens=10)
    c = sample(start=-4.0, first=-3.0, end=2.0, tokens=40)
    row = lm.summarize_stage([a, b, c], window(run_end=10.0, users=2), lm.Slo())
    assert row.user_tok_s_e2e_mean == pytest.approx((20 / 4 + 10 / 2) / 2)  # TTFT included
    assert row.user_tok_s_mean == pytest.approx((19 / 3 + 9 / 1.5) / 2)  # after the first
    assert row.output_tok_s_same == pytest.approx(2 * 30 / 6)  # users x tokens / busy time
    assert row.output_tok_s_total != pytest.approx(row.output_tok_s_same)
    failed = sample(start=2.0, first=None, end=3.0, tokens=None, ok=False)
    assert lm.summarize_stage([failed], window(users=2), lm.Slo()).output_tok_s_same is None


def test_a_stage_without_completed_requests_reports_zeros_and_nones():
    row = lm.summarize_stage([], window(users=4), lm.Slo())
    assert (row.requests, row.failures, row.completed_in_window) == (0, 0, 0)
    assert row.output_tok_s_total == 0.0 and row.requests_per_s == 0.0 and row.goodput_rps == 0.0
    assert row.ttft_p50_s is None and row.user_tok_s_mean is None and row.itl_p99_s is None
    assert "no request started" in row.note and row.slo_met is None
    problems = lm.run_problems([row], lm.Slo())
    assert len(problems) == 1 and "nothing was measured" in problems[0]  # exit code 1
    json.dumps(row.to_dict())
    assert "-" in lm.format_table([row.to_dict()]).splitlines()[1]
    # With an SLO, a stage that cannot show it was met breaches it.
    slo = lm.Slo(ttft_s=1.0)
    row = lm.summarize_stage([], window(), slo)
    assert row.slo_met is False and "SLO breached" in lm.run_problems([row], slo)[1]


def test_slo_attainment_goodput_and_breach():
    ttfts = [0.1, 0.2, 0.5, 1.0]
    samples = [
        sample(start=i, first=i + t, end=i + t + 1.0, tokens=11) for i, t in enumerate(ttfts)
    ]  # TPOT 0.1 s each
    w = window(run_end=10.0)
    strict = lm.Slo(ttft_s=0.3, tpot_s=0.2, attainment=0.9)
    row = lm.summarize_stage(samples, w, strict)
    assert row.slo_attainment == 0.5 and row.slo_met is False
    assert row.goodput_rps == pytest.approx(2 / 10) and row.requests_per_s == pytest.approx(0.4)
    problems = lm.run_problems([row], strict)
    assert len(problems) == 1 and "50.0%" in problems[0] and "TTFT<=0.3" in problems[0]
    loose = lm.Slo(ttft_s=2.0, tpot_s=0.2)
    row = lm.summarize_stage(samples, w, loose)
    assert row.slo_met is True and row.goodput_rps == row.requests_per_s
    assert lm.run_problems([row], loose) == []
    tight_tpot = lm.Slo(tpot_s=0.05)
    assert lm.summarize_stage(samples, w, tight_tpot).slo_attainment == 0.0


def test_quantiles_interpolate_between_order_statistics():
    assert lm.quantile([], 0.5) is None
    assert lm.quantile([3.0], 0.99) == 3.0
    assert lm.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert lm.quantile(range(101), 0.9) == pytest.approx(90.0)


# ------------------------------------------------------------------------------------------
# the shape: hold, then drain


def test_the_sweep_holds_drains_and_only_then_moves_on():
    clock = lm.SweepClock([2, 1], stage_seconds=10.0, warmup_s=1.0, drain_timeout_s=30.0)
    assert clock.tick(0.0) == (2, [("start", 0)])
    assert clock.acquire(0.1) == 0 and clock.acquire(0.1) == 0
    assert clock.acquire(0.2) is None  # both users busy: never more than the stage's users
    clock.release(0, 3.0)
    assert clock.acquire(3.0) == 0
    assert clock.tick(9.0) == (2, [])
    assert clock.acquire(10.0) is None  # the hold is over: nothing new
    assert clock.tick(10.5) == (2, [])  # still draining two requests
    clock.release(0, 11.0)
    clock.release(0, 12.0)
    assert clock.tick(12.3) == (2, [("end", 0)])  # the caller snapshots the server here
    assert clock.acquire(12.3) is None
    assert clock.tick(12.35) == (1, [("start", 1)])
    first = clock.stages[0]
    assert (first.window_start, first.window_end, first.drain_incomplete) == (1.0, 10.0, 0)
    row = lm.summarize_stage([], first, lm.Slo())
    assert row.drain_s == pytest.approx(2.0)  # until the last answer at t=12
    assert clock.acquire(12.4) == 1
    clock.release(1, 20.0)
    assert clock.tick(22.4) == (None, [("end", 1)])
    assert clock.tick(23.0) == (None, [])


def test_a_drain_that_never_ends_times_out_and_is_reported():
    clock = lm.SweepClock([1], stage_seconds=5.0, warmup_s=0.0, drain_timeout_s=2.0)
    clock.tick(0.0)
    assert clock.acquire(1.0) == 0
    assert clock.tick(6.0) == (1, [])
    assert clock.tick(7.5) == (None, [("end", 0)])
    row = lm.summarize_stage([], clock.stages[0], lm.Slo())
    problems = lm.run_problems([row], lm.Slo())
    assert row.drain_incomplete == 1 and any("still running" in p for p in problems)


# ------------------------------------------------------------------------------------------
# configuration and prompts


def test_config_reads_the_sla_variables_and_explains_bad_values(tmp_path):
    cfg = lm.SlaConfig.from_env(
        {
            "SLA_USERS": "1, 8",
            "SLA_STAGE_SECONDS": "30",
            "SLA_IGNORE_EOS": "1",
            "SLA_MAX_TOKENS": "64",
            "SLA_EXTRA_BODY": '{"top_p": 0.5}',
            "SLA_SLO_TTFT_S": "2",
        }
    )
    assert cfg.users == (1, 8) and cfg.warmup_seconds == 3.0 and cfg.slo.ttft_s == 2.0
    body = cfg.request_body("m", "hi")
    assert body["ignore_eos"] is True and body["max_tokens"] == 64 and body["top_p"] == 0.5
    assert body["stream_options"]["include_usage"] is True and body["stream"] is True
    assert "ignore_eos" not in lm.SlaConfig.from_env({}).request_body("m", "hi")
    for env, name in [
        ({"SLA_USERS": "0,2"}, "SLA_USERS"),
        ({"SLA_USERS": "a"}, "SLA_USERS"),
        ({"SLA_STAGE_SECONDS": "x"}, "SLA_STAGE_SECONDS"),
        ({"SLA_STAGE_SECONDS": "10", "SLA_WARMUP_SECONDS": "10"}, "SLA_WARMUP"),
        ({"SLA_IGNORE_EOS": "maybe"}, "SLA_IGNORE_EOS"),
        ({"SLA_SLO_TPOT_S": "-1"}, "SLA_SLO_TPOT_S"),
        ({"SLA_PROMPTS_FILE": str(tmp_path / "nope.jsonl")}, "SLA_PROMPTS_FILE"),
    ]:
        with pytest.raises(ValueError, match=name):
            lm.SlaConfig.from_env(env)


def test_prompt_files_jsonl_and_sharegpt_are_told_apart(tmp_path):
    ours = tmp_path / "ours.jsonl"
    ours.write_text('{"turns": ["first", "second"]}\n\n{"turns": ["again"]}\n')
    share = tmp_path / "sharegpt.json"
    share.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "system", "value": "be nice"},
                        {"from": "human", "value": "hello"},
                        {"from": "gpt", "value": "hi"},
                    ]
                },
                {"conversations": [{"from": "gpt", "value": "no human turn"}]},
            ]
        )
    )
    assert lm.load_prompts_file(ours) == ("first", "again")
    assert lm.load_prompts_file(share) == ("hello",)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="holds no prompts"):
        lm.load_prompts_file(bad)


def test_default_prompts_mix_the_eval_files_else_the_builtin_ones(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text('{"turns": ["g1"]}\n{"turns": ["g2"]}\n')
    (tmp_path / "mt-bench.jsonl").write_text('{"turns": ["m1"]}\n')
    prompts, source = lm.default_prompts([tmp_path / "missing", tmp_path])
    assert prompts == ("g1", "m1", "g2") and "gsm8k.jsonl" in source
    assert lm.default_prompts([tmp_path / "missing"]) == (lm.DEFAULT_PROMPTS, "built-in")


def test_input_length_is_controlled_in_words():
    assert lm.fit_prompt("one two three four", 2) == "one two"
    assert lm.fit_prompt("a b", 5).split() == ["a", "b", "a", "b", "a"]


def test_server_info_names_the_arm():
    info = {
        "speculative_algorithm": "DSPARK",
        "speculative_num_draft_tokens": 8,
        "internal_states": [
            {"avg_spec_accept_length": 3.0, "dspark_info_record": {"x": 1}},
            {"avg_spec_accept_length": 4.0},
        ],
    }
    assert (
        lm.arm_label("", info) == "dspark-k8" and lm.arm_label("dspark-sync", info) == "dspark-sync"
    )
    assert lm.arm_label("", {"speculative_algorithm": None, "model_path": "m"}) == "no-spec"
    assert lm.server_accept_length(info) == 3.5
    assert "dspark_info_record" not in lm.trim_server_info(info)["internal_states"][0]


def test_the_helm_chart_ships_this_sla_py():
    assert (REPO / "helm" / "dspark" / "files" / "sla.py").read_bytes() == SLA.read_bytes()


# ------------------------------------------------------------------------------------------
# Pareto curves


def write_summary(path: Path, label: str, points, algorithm=None, k=None, verify=None) -> Path:
    stages = []
    for i, (users, x, y) in enumerate(points):
        stages.append(
            {
                "stage": i,
                "users": users,
                "user_tok_s_mean": x,
                "user_tok_s_p50": x,
                "user_tok_s_e2e_mean": x,
                "output_tok_s_total": y,
                "output_tok_s_same": y,
                "accept_len": None,
                "verify_len_mean": verify[i] if verify else None,
            }
        )
    report = {
        "schema": lm.SCHEMA,
        "label": label,
        "stages": stages,
        "server": {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": k},
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "sla_summary.json").write_text(json.dumps(report))
    return path


BASE = [(1, 100.0, 100.0), (4, 80.0, 280.0), (16, 50.0, 600.0), (32, 40.0, 550.0)]
ARM = [(1, 150.0, 150.0), (4, 120.0, 420.0), (16, 70.0, 900.0)]


def test_frontier_excludes_dominated_points():
    pts = [pareto.Point(u, x, y) for u, x, y in BASE]
    assert [p.users for p in pareto.frontier(pts)] == [16, 4, 1]  # c=32 is beaten by c=16
    dup = pts + [pareto.Point(99, 50.0, 600.0)]
    assert len(pareto.frontier(dup)) == 3


def test_interpolated_gains_match_hand_computed_values():
    arm = pareto.frontier([pareto.Point(u, x, y) for u, x, y in ARM])
    base = pareto.frontier([pareto.Point(u, x, y) for u, x, y in BASE])
    # Matched tok/s/user: overlap x in [70, 100]. At x=80 the arm's frontier reads
    # 900 + (420 - 900) * (80 - 70) / (120 - 70) = 804 against the baseline's 280.
    tg = pareto.gain(arm, base, "x")
    assert tg.overlap == (70.0, 100.0)
    at = {p["users"]: p["gain"] for p in tg.at_baseline_points}
    assert at == {4: pytest.approx(804 / 280), 1: pytest.approx(612 / 100)}
    assert tg.max_gain == pytest.approx(6.12) and tg.at == 100.0
    # Matched throughput: overlap y in [150, 600]. At y=600 the arm runs at
    # 70 + 50 * (600 - 900) / (420 - 900) = 101.25 tok/s/user against 50.
    sg = pareto.gain(arm, base, "y")
    assert sg.overlap == (150.0, 600.0)
    at = {p["users"]: p["gain"] for p in sg.at_baseline_points}
    assert at == {16: pytest.approx(101.25 / 50), 4: pytest.approx((120 + 30 * 140 / 270) / 80)}
    assert sg.max_gain == pytest.approx(2.025) and sg.at == 600.0
    assert all(g <= sg.max_gain + 1e-12 for _, g in sg.grid)
    # No overlap, no extrapolated gain.
    far = [pareto.Point(1, 1000.0, 10.0)]
    assert pareto.gain(far, base, "x") is None


def test_pareto_cli_writes_the_plots_and_tables(tmp_path):
    from sglang_dspark.cli import main

    write_summary(tmp_path / "runs" / "a", "mtp1", BASE, "EAGLE", 2)
    write_summary(tmp_path / "runs" / "b", "dspark", ARM, "DSPARK", 8, verify=[7.5, 5.0, 3.25])
    write_summary(tmp_path / "runs" / "c", "no-spec", [(1, 60.0, 60.0), (16, 30.0, 480.0)])
    out = tmp_path / "plots"
    argv = ["pareto", str(tmp_path / "runs"), "--out", str(out), "--baseline", "mtp1"]
    assert main(argv) == 0
    for name in ("pareto.png", "verify_budget.png", "pareto.csv", "pareto.json"):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "pareto.json").read_text())
    c = result["comparison"]
    assert (c["arm"], c["baseline"]) == ("dspark", "mtp1")  # the DSPARK arm by default
    assert c["throughput_gain_at_matched_user_tok_s"]["max_gain"] == pytest.approx(6.12)
    assert c["user_speed_gain_at_matched_throughput"]["max_gain"] == pytest.approx(2.025)
    assert "piecewise-linear" in result["method"]
    series = {s["label"]: s for s in result["verify_budget"]}
    assert series["mtp1 (fixed 2)"]["points"] == [[1, 2.0], [4, 2.0], [16, 2.0], [32, 2.0]]
    assert series["dspark"]["points"] == [[1, 7.5], [4, 5.0], [16, 3.25]]
    rows = (out / "pareto.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 + 3 + 2
    assert "mtp1,32,40.0,550.0,,,False,1,,,," in rows
    # A summary from before the same-request metrics: a clear refusal, and the old metrics work.
    old = json.loads((tmp_path / "runs" / "a" / "sla_summary.json").read_text())
    for row in old["stages"]:
        del row["user_tok_s_e2e_mean"], row["output_tok_s_same"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "sla_summary.json").write_text(json.dumps(old))
    argv = ["pareto", str(tmp_path / "old"), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert main(argv + ["--x-metric", "mean", "--y-metric", "window"]) == 0


def test_rounds_give_confidence_intervals_and_paired_gains(tmp_path):
    from scipy import stats

    def with_rounds(path, label, algorithm, rounds):
        # rounds: per round, the (users, x, y) points; the row holds their means
        stages = []
        for i, users in enumerate(u for u, _, _ in rounds[0]):
            xs = [r[i][1] for r in rounds]
            ys = [r[i][2] for r in rounds]
            row = {"users": users, "user_tok_s_e2e_mean": sum(xs) / len(xs),
                   "output_tok_s_same": sum(ys) / len(ys),
                   "rounds": {"user_tok_s_e2e_mean": xs, "output_tok_s_same": ys}}  # fmt: skip
            stages.append(row)
        server = {"speculative_algorithm": algorithm}
        path.mkdir(parents=True)
        (path / "sla_summary.json").write_text(
            json.dumps({"schema": lm.SCHEMA, "label": label, "stages": stages, "server": server})
        )

    base = [[(1, 10.0, 10.0), (4, 8.0, 30.0)], [(1, 11.0, 11.0), (4, 9.0, 33.0)],
            [(1, 9.0, 9.0), (4, 7.0, 27.0)]]  # fmt: skip
    # The arm is 1.5x the baseline's throughput at the same x in round 0 and 2, 1.2x in round 1.
    arm = [[(1, 10.0, 15.0), (4, 8.0, 45.0)], [(1, 11.0, 13.2), (4, 9.0, 39.6)],
           [(1, 9.0, 13.5), (4, 7.0, 40.5)]]  # fmt: skip
    with_rounds(tmp_path / "runs" / "b", "base", "EAGLE", base)
    with_rounds(tmp_path / "runs" / "a", "arm", "DSPARK", arm)
    result = pareto.run_pareto([tmp_path / "runs"], tmp_path / "out")
    pts = {a["label"]: {p["users"]: p for p in a["points"]} for a in result["arms"]}
    ys = [10.0, 11.0, 9.0]
    half = stats.t.ppf(0.975, 2) * stats.sem(ys)
    assert pts["base"][1]["y_ci"] == pytest.approx([10 - half, 10 + half])
    assert pts["base"][1]["rounds"] == 3 and pts["arm"][4]["x_ci"] == pts["base"][4]["x_ci"]
    by_round = result["comparison"]["rounds"]["throughput_gain_at_matched_user_tok_s"]
    assert by_round["max"]["per_round"] == pytest.approx([1.5, 1.2, 1.5])
    assert by_round["min"]["per_round"] == pytest.approx([1.5, 1.2, 1.5])
    assert by_round["min"]["ci"][0] < 1.4 < by_round["min"]["ci"][1]
    text = pareto.render(result)
    assert "round by round (3 of 3 overlap): min 1.40x" in text
    rows = (tmp_path / "out" / "pareto.csv").read_text().splitlines()
    assert rows[0].endswith("rounds,user_tok_s_ci_low,user_tok_s_ci_high,output_tok_s_ci_low,"
                            "output_tok_s_ci_high")  # fmt: skip
    assert all(r.split(",")[7] == "3" for r in rows[1:])


def test_python_m_pareto_is_the_same_code_and_divides_by_replicas(tmp_path):
    a = write_summary(tmp_path / "a", "x", ARM, "DSPARK")
    b = write_summary(tmp_path / "b", "y", BASE)
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_dspark.measurement.pareto",
            str(a),
            str(b),
            "--out",
            str(out),
            "--label",
            "dspark",
            "--label",
            "base",
            "--replicas",
            "2",
            "--arm",
            "dspark",
            "--baseline",
            "base",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    arms = {a["label"]: a for a in json.loads((out / "pareto.json").read_text())["arms"]}
    assert arms["dspark"]["points"][0]["y"] == 75.0  # 150 / 2 replicas
    assert "dspark vs base" in result.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_dspark.measurement.pareto",
            str(a),
            "--out",
            str(out),
            "--arm",
            "nope",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert bad.returncode == 2 and "no arm labelled 'nope'" in bad.stderr


# ------------------------------------------------------------------------------------------
# Locust runs (subprocesses)


def run_locust(host: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    env = {"SLA_OUTPUT_DIR": str(out), **env}
    return subprocess.run(
        [str(LOCUST), "-f", str(SLA), "--headless", "--host", host, "--only-summary"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=out.parent,
        env=os.environ | env,
    )


class _Multi(BaseHTTPRequestHandler):
    """Streams 3 tokens per chunk with cumulative usage; `with_usage=False` drops usage."""

    protocol_version = "HTTP/1.0"
    with_usage = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = {
            "/v1/models": {"data": [{"id": "fake"}]},
            "/server_info": {
                "model_path": "fake",
                "speculative_algorithm": "DSPARK",
                "speculative_num_draft_tokens": 4,
            },
        }.get(self.path)
        data = json.dumps(body).encode()
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = request["max_tokens"]
        for done in range(3, n + 1, 3):
            event = content("tok " * 3, done if self.with_usage else None)
            self.wfile.write(sse(event, done=False))
            self.wfile.flush()
            time.sleep(0.005)
        self.wfile.write(sse(usage(n)) if self.with_usage else sse())


@pytest.fixture
def multi_server():
    handler = type("Handler", (_Multi,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_locust_counts_usage_tokens_and_fails_without_usage(multi_server, tmp_path):
    handler, url = multi_server
    common = {"SLA_USERS": "2", "SLA_STAGE_SECONDS": "3", "SLA_MAX_TOKENS": "12"}
    result = run_locust(url, tmp_path / "ok", **common)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "ok" / "sla_summary.json").read_text())
    assert report["label"] == "dspark-k4" and report["server"]["model_path"] == "fake"
    ok = [s for s in report["samples"] if s["ok"]]
    assert ok and all(s["output_tokens"] == 12 and s["content_chunks"] == 4 for s in ok)
    assert report["stages"][0]["itl_p50_s"] is not None
    handler.with_usage = False
    result = run_locust(url, tmp_path / "no-usage", **common)
    assert result.returncode == 1
    assert "no usage.completion_tokens" in result.stderr
    report = json.loads((tmp_path / "no-usage" / "sla_summary.json").read_text())
    assert report["stages"][0]["missing_usage"] > 0 and report["stages"][0]["output_tokens"] == 0


@pytest.mark.slow
def test_locust_says_when_the_server_is_unreachable(tmp_path):
    result = run_locust("http://127.0.0.1:9", tmp_path / "out", SLA_USERS="1")
    assert result.returncode == 1
    assert "could not reach http://127.0.0.1:9/v1/models" in result.stderr
    assert "is the server running?" in result.stderr


@pytest.mark.sglang
@pytest.mark.slow
def test_locust_against_a_real_server(embedded_paths, servers, tmp_path):
    server = servers.get(embedded_paths, speculative=False)
    out = tmp_path / "run"
    # No warm-up: on a busy 2-core machine one request can take longer than a stage, and
    # each stage must measure at least its first requests (warm-up exclusion: unit tests).
    result = run_locust(
        server.base_url,
        out,
        SLA_USERS="1,2",
        SLA_STAGE_SECONDS="12",
        SLA_WARMUP_SECONDS="0",
        SLA_MAX_TOKENS="16",
        SLA_IGNORE_EOS="1",
    )
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "sla_summary.json").read_text())
    assert report["server"]["model_path"] == str(embedded_paths.target)
    assert report["label"] == "no-spec" and report["server"]["speculative_algorithm"] is None
    assert [r["users"] for r in report["stages"]] == [1, 2]
    samples = [lm.Sample.from_dict(s) for s in report["samples"]]
    assert all(s.ok and s.output_tokens == 16 for s in samples)  # ignore_eos
    for row, w in zip(report["stages"], report["stage_windows"], strict=True):
        started = [s for s in samples if w["run_start"] + w["warmup_s"] <= s.start < w["run_end"]]
        assert row["requests"] == len(started) > 0 and row["failures"] == 0
        assert row["output_tokens"] == 16 * len(started)
        # Closed loop, no think time: each user turns out its tokens / its busy time, so the
        # aggregate is about users x sum(tokens) / sum(latency). That holds once each user ran
        # a few requests in the window; on a machine so busy that a request outlasts much of
        # the stage, the window's edges dominate and only the upper bound is sure.
        closed_loop = (
            row["users"] * sum(s.output_tokens for s in started) / sum(s.e2e for s in started)
        )
        # (A stage whose requests stream no token inside the window, e.g. a TTFT of 13 s in a
        # 12 s stage on an overloaded machine, reads 0 tok/s, which is then the right answer.)
        assert 0 <= row["output_tok_s_total"] <= 1.4 * closed_loop
        if len(started) >= 3 * row["users"]:
            assert 0.6 * closed_loop <= row["output_tok_s_total"]
        assert row["user_tok_s_p50"] > 0 and 0 < row["ttft_p50_s"] < row["e2e_p50_s"]
        assert row["tpot_p50_s"] == pytest.approx(1 / row["user_tok_s_p50"], rel=0.5)
        assert row["itl_p50_s"] > 0  # SGLang streams usage per chunk
        assert 0 < row["client_cpu_share"] < 1
    assert (out / "sla_summary.csv").read_text().count("\n") == 3
    # An impossible SLO fails the run.
    strict = run_locust(
        server.base_url,
        tmp_path / "strict",
        SLA_USERS="1",
        SLA_STAGE_SECONDS="6",
        SLA_WARMUP_SECONDS="0",
        SLA_MAX_TOKENS="8",
        SLA_SLO_TTFT_S="0.000001",
    )
    assert strict.returncode == 1 and "SLO breached" in strict.stderr

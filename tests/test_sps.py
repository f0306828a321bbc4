"""SPS(B) profiling helpers, the on-disk cache, the plot, and the scheduler-mode settings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from sglang.srt.speculative.dspark_components.dspark_sps import (
    SpsAdditiveCostTable,
    SpsCostTable,
    load_sps_table_from_path,
)

from sglang_dspark.plugin.scheduling import SchedulerConfigError, apply_mode_env
from sglang_dspark.scheduling import sps


def _key(**kw) -> sps.SpsKey:
    base = {
        "model": "/m",
        "model_config_sha": "abc",
        "dtype": "bfloat16",
        "device": "cpu:x:2cpu",
        "attention_backend": "torch_native",
        "tp_size": 1,
        "threads": 2,
        "sglang_version": "0.5.23",
        "torch_version": "2.14.1",
        "max_requests": 16,
        "verify_tokens": (1, 2, 3, 4, 8),
        "draft_requests": (1, 2, 4),
    }
    base.update(kw)
    return sps.SpsKey(**base)


# Synthetic CPU-like costs (seconds): a verify forward that grows with batch tokens m and a
# draft pass that grows with requests R, as measured on the embedded server's scale.
def _verify_s(m: int) -> float:
    return 0.045 + 0.0012 * (m - 1)


def _draft_s(r: int) -> float:
    return 0.012 + 0.004 * r


def _additive(*, draft: bool = True, max_requests: int = 16, k: int = 8):
    verify = {m: [_verify_s(m)] * 3 for m in sps.verify_token_probes(max_requests, k)}
    drafts = {r: [_draft_s(r)] * 3 for r in sps.draft_request_probes(max_requests)}
    return sps.additive_table_from_timings(verify, drafts if draft else None)


def _staircase(max_requests: int = 16, k: int = 8) -> SpsCostTable:
    """The table of TABLE_VERSION 3: verify only, powers of two, floor lookup."""
    xs = [2**i for i in range((max_requests * k).bit_length())]
    return SpsCostTable(
        sample_batch_tokens=xs,
        sample_steps_per_sec=[1.0 / _verify_s(x) for x in xs],
        max_batch_tokens=xs[-1],
    )


def test_probes_cover_every_small_batch_and_the_full_window():
    ms = sps.verify_token_probes(16, 8)
    assert ms[:10] == list(range(1, 11)) and ms[-1] == 128
    assert {16, 32, 64, 96}.issubset(ms)
    for m in ms:
        r, k = sps.verify_shape(m, 16, 8)
        assert r * k == m and k <= 8 and r <= 16
    assert sps.verify_shape(8, 16, 8) == (1, 8) and sps.verify_shape(16, 16, 8) == (2, 8)
    assert sps.draft_request_probes(16) == [1, 2, 4, 8, 16]
    assert sps.draft_request_probes(5) == [1, 2, 4, 5]


def test_fitted_table_reproduces_the_timings_it_was_fitted_on():
    table = _additive()
    assert isinstance(table, SpsAdditiveCostTable)
    for r in (1, 2, 3, 5, 16):  # 5 is between alpha probes: linear, exact here
        for m in (r, r + 1, 11, 13, 8 * r):  # 11 and 13 are not probed: interpolated
            if m < r or m > 128:
                continue
            want = _verify_s(m) + _draft_s(r)
            assert table.step_time(num_reqs=r, budget=m - r) == pytest.approx(want, rel=1e-9)
            assert sps.step_seconds(table, num_reqs=r, batch_tokens=m) == pytest.approx(want)
    # medians of repeats, and noise never makes a bigger batch or more requests cheaper
    noisy = sps.additive_table_from_timings(
        {1: [0.05, 0.9, 0.05], 2: [0.04], 4: [0.06]}, {1: [0.01], 2: [0.008], 4: [0.02]}
    )
    assert noisy.bias_seconds == pytest.approx(0.045)  # 0.05 then 0.04: pooled to their mean
    assert noisy.theta_seconds == pytest.approx([0.0, 0.0, 0.015])
    assert noisy.alpha_seconds == pytest.approx([0.009, 0.009, 0.02])
    # a slow first probe is averaged with its neighbour, not carried up the curve
    spike = sps.additive_table_from_timings({1: [0.07], 2: [0.05], 4: [0.06], 8: [0.08]})
    assert spike.bias_seconds == pytest.approx(0.06)
    assert spike.theta_seconds == pytest.approx([0.0, 0.0, 0.0, 0.02])
    with pytest.raises(ValueError):
        sps.additive_table_from_timings({})
    # no draft timings: the verify-only table (alpha = 0)
    assert _additive(draft=False).alpha_seconds == [0.0]


def test_time_calls_runs_warmup_and_repeats_per_point():
    calls = []
    out = sps.time_calls(lambda x: calls.append(x), [2, 4], repeats=3, warmup=1)
    assert calls == [2, 4] * 4  # one warm-up sweep, then three timed sweeps
    assert sorted(out) == [2, 4] and all(len(v) == 3 for v in out.values())


def test_algorithm1_at_one_request_picks_intermediate_windows():
    """R = 1, the same confidence c at every position: as c rises the window should grow one
    draft at a time. The powers-of-two floor table is flat inside [4, 8): every draft there is
    free, so the window only ever ends just before a probe (0, 2, 6 drafts) or takes all 7."""
    from sglang_dspark.scheduling.scheduler import schedule_sync

    def windows(table) -> set[int]:
        out = set()
        for i in range(5, 100):
            c = torch.full((1, 7), i / 100.0)
            out.add(int(schedule_sync(c, table)[0]))
        return out

    staircase = windows(_staircase())
    smooth = windows(_additive())
    assert staircase <= {0, 2, 6, 7}
    assert set(range(1, 7)) <= smooth  # every intermediate window occurs
    # and upstream's planner (async) prices the same table the same way
    from sglang.srt.speculative.dspark_components.dspark_planner import (
        DSparkScheduleConfig,
        compute_verify_token_budget,
    )

    budgets = {
        compute_verify_token_budget(
            history_survival_probs=torch.cumprod(torch.full((1, 7), i / 100.0), 1),
            sps_table=_additive(),
            cfg=DSparkScheduleConfig(gamma=7),
        ).budget
        for i in range(5, 100)
    }
    assert set(range(1, 7)) <= budgets


def test_draft_cost_makes_the_optimal_budget_at_high_load_larger():
    """Every round pays the draft pass whatever it verifies; a table that prices it makes each
    extra verify token relatively cheaper, so at 16 requests the planner verifies more."""
    from sglang.srt.speculative.dspark_components.dspark_planner import (
        DSparkScheduleConfig,
        compute_verify_token_budget,
    )

    from sglang_dspark.scheduling.scheduler import schedule_sync

    c = torch.rand(16, 7, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.45
    cfg = DSparkScheduleConfig(gamma=7)
    a = torch.cumprod(c, 1)
    with_draft = compute_verify_token_budget(
        history_survival_probs=a, sps_table=_additive(), cfg=cfg
    ).budget
    verify_only = compute_verify_token_budget(
        history_survival_probs=a, sps_table=_additive(draft=False), cfg=cfg
    ).budget
    assert with_draft > verify_only
    assert int(schedule_sync(c, _additive()).sum()) > int(
        schedule_sync(c, _additive(draft=False)).sum()
    )
    # one request: the draft pass is small next to the verify forward, the window is the same
    c1 = c[:1]
    assert (
        schedule_sync(c1, _additive()).tolist()
        >= schedule_sync(c1, _additive(draft=False)).tolist()
    )


def test_cache_key_changes_with_every_field():
    base = _key()
    for field in dataclasses.fields(sps.SpsKey):
        value = getattr(base, field.name)
        if isinstance(value, str):
            other = value + "x"
        elif isinstance(value, tuple):
            other = value + (16,)
        else:
            other = value + 1
        assert dataclasses.replace(base, **{field.name: other}).digest() != base.digest(), field


def test_cache_round_trip_and_keying(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    key = _key()
    assert sps.load_cached(key) is None
    table = _additive()
    path = sps.save_cached(key, table, seconds=1.5)
    assert path.parent == tmp_path / "sps"
    assert sps.load_cached(key) == table
    record = json.loads(path.read_text())
    assert record["key"]["dtype"] == "bfloat16" and record["key"]["version"] == sps.TABLE_VERSION
    assert record["table"]["bs_probes"] == [1, 2, 4, 8, 16] and record["profile_seconds"] == 1.5
    # The bare table beside it is what --speculative-dspark-sps-table-path takes, read by SGLang.
    assert load_sps_table_from_path(str(sps.bare_table_path(key))) == table
    # A floor table (e.g. written by an older plugin under another key) still reads back.
    floor = SpsCostTable(sample_batch_tokens=[1, 8], sample_steps_per_sec=[9.0, 8.0],
                         max_batch_tokens=8)  # fmt: skip
    sps.save_cached(_key(dtype="x"), floor, seconds=0.0)
    assert sps.load_cached(_key(dtype="x")) == floor
    # Another dtype is another table.
    assert sps.load_cached(_key(dtype="float32")) is None


def test_corrupt_cache_file_reads_as_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    key = _key()
    sps.cache_path(key).parent.mkdir(parents=True)
    sps.cache_path(key).write_text("{not json")
    assert sps.load_cached(key) is None  # profiled again at start-up


# ---------------------------------------------------------------- tensor parallel: one table
def _tp_worker(rank: int, world: int, init: str, cache_dirs: list, out_dir: str, cached: bool):
    """One TP rank of the plugin's start-up: cache read, profile, install, cache write."""
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    os.environ["DSPARK_CACHE_DIR"] = cache_dirs[rank]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from sglang.srt.runtime_context import get_context

    from sglang_dspark.plugin import parallel, scheduling

    parallel.tp_cpu_group = lambda: dist.group.WORLD
    parallel.tp_rank = lambda: rank
    # each rank "times" its own forwards: rank r's are r + 1 times slower
    scale = rank + 1
    sps.profile_verify = lambda runner, *, verify_num_draft_tokens, max_requests: {
        m: [scale * _verify_s(m)] * 3 for m in sps.verify_token_probes(max_requests, 8)
    }
    runner = SimpleNamespace(
        server_args=SimpleNamespace(model_path=cache_dirs[0], attention_backend="x", tp_size=world),
        dtype=torch.bfloat16, device="meta",  # not "cpu": the instant fake profile is not contended
    )  # fmt: skip
    key = scheduling.sps_key_for(runner, verify_num_draft_tokens=8, max_requests=4)
    if cached and rank == 0:
        sps.save_cached(key, _staircase(4), seconds=0.0)
    planner = SimpleNamespace(_budget_planner=SimpleNamespace(sps_table=None))
    with get_context().override_server_args(device="cpu", max_running_requests=4):
        scheduling._planner_ctx["runner"] = runner
        scheduling._planner_ctx["draft"] = {"draft_model": None, "gamma": 7, "tp_sync": None}
        first = scheduling._build_sps_table(lambda **kw: None, verify_num_draft_tokens=8)
        job = scheduling._planner_ctx.pop("pending", None)
        scheduling._planner_ctx.clear()
        if job is not None:
            job["planner"] = planner
            scheduling._pending.append(job)
            scheduling._profile_after_graphs(None, runner)
    table = planner._budget_planner.sps_table if job is not None else first
    result = {"profiled": job is not None, "table": json.loads(table.to_json()),
              "wrote": sps.cache_path(key).is_file()}  # fmt: skip
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run_tp(tmp_path, *, cached: bool) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dirs = [str(tmp_path / f"cache{r}") for r in range(2)]
    mp.spawn(_tp_worker, args=(2, f"tcp://127.0.0.1:{port}", dirs, str(tmp_path), cached),
             nprocs=2, join=True)  # fmt: skip
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_tp_ranks_profile_together_and_install_rank_0s_table(tmp_path):
    r0, r1 = _run_tp(tmp_path, cached=False)
    assert r0["profiled"] and r1["profiled"]  # both ran the forwards (lockstep collectives)
    assert r0["table"] == r1["table"]  # but one table: rank 0's timings
    theta0 = r0["table"]["theta_seconds"]
    own = sps.additive_table_from_timings(
        {m: [_verify_s(m)] * 3 for m in sps.verify_token_probes(4, 8)}
    )
    assert theta0 == pytest.approx(own.theta_seconds)  # scale 1: rank 0's, not rank 1's (x2)
    assert (r0["wrote"], r1["wrote"]) == (True, False)  # only rank 0 writes the cache


@pytest.mark.slow
def test_tp_ranks_take_rank_0s_cached_table_even_when_theirs_is_missing(tmp_path):
    r0, r1 = _run_tp(tmp_path, cached=True)
    # rank 1 has no cache file; had it profiled while rank 0 read its table, the profile's
    # collectives would have waited forever
    assert not r0["profiled"] and not r1["profiled"]
    assert r0["table"] == r1["table"] == json.loads(_staircase(4).to_json())


@pytest.mark.parametrize("kind", ["additive", "floor"])
def test_plot_writes_a_png(tmp_path, kind):
    table = _additive() if kind == "additive" else _staircase()
    out = sps.plot_table(table, tmp_path / "sps.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bias=45.0 ms" in sps.describe(_additive())


# ------------------------------------------------------------------ scheduler mode settings
@pytest.mark.parametrize(
    "mode, ragged",
    [("static", "static"), ("async", "compact"), ("sync", "compact"), ("SYNC", "compact")],
)
def test_scheduler_mode_sets_the_ragged_verify_mode(mode, ragged):
    env = {"SGLANG_DSPARK_SCHEDULER": mode}
    assert apply_mode_env(env) == mode.lower()
    assert env["SGLANG_RAGGED_VERIFY_MODE"] == ragged


def test_scheduler_mode_unset_leaves_upstream_alone():
    env = {"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}
    assert apply_mode_env(env) is None
    assert env == {"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}


def test_bad_or_conflicting_scheduler_mode_is_refused_with_the_fix():
    with pytest.raises(SchedulerConfigError, match="not one of static, async, sync"):
        apply_mode_env({"SGLANG_DSPARK_SCHEDULER": "fast"})
    with pytest.raises(SchedulerConfigError, match="unset SGLANG_RAGGED_VERIFY_MODE"):
        apply_mode_env({"SGLANG_DSPARK_SCHEDULER": "sync", "SGLANG_RAGGED_VERIFY_MODE": "static"})


def test_a_contended_cpu_profile_is_flagged_and_never_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    quiet = sps.cpu_share(0.95 * threads * 10.0, 10.0, "cpu")
    busy = sps.cpu_share(0.4 * threads * 10.0, 10.0, "cpu")
    assert sps.busy_reason(quiet) is None
    reason = sps.busy_reason(busy)
    assert reason and f"of its {min(threads, __import__('os').cpu_count())} threads" in reason
    assert sps.cpu_share(1.0, 10.0, "cuda") is None  # off the CPU the host mostly waits
    key = _key()
    path = sps.save_cached(key, _additive(), seconds=30.0, busy=True, cpu=busy)
    assert path == sps.busy_path(key) and path.is_file()
    assert sps.load_cached(key) is None  # profiled again at the next start
    assert not sps.bare_table_path(key).exists()
    sps.save_cached(key, _additive(), seconds=6.0, cpu=quiet)
    assert sps.load_cached(key) == _additive()
    assert json.loads(sps.cache_path(key).read_text())["cpu"] == quiet


def test_the_start_up_log_line_names_the_table_file_in_every_case():
    for line, want in [
        ("DSpark SPS table profiled at start-up in 6.6 s, cached at /c/a.json: bias=1", "/c/a.json"),
        (("DSpark SPS table profiled at start-up in 26.4 s, not cached (contended), written to "
          "/c/a.busy.json: bias=1"), "/c/a.busy.json"),
        ("DSpark SPS table read from /c/a.json: bias=1", "/c/a.json"),
    ]:  # fmt: skip
        assert sps.STARTUP_LINE.findall(line) == [want]

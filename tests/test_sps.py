"""SPS(B) profiling helpers, the on-disk cache, the plot, and the scheduler-mode settings."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sglang.srt.speculative.dspark_components.dspark_sps import (
    SpsCostTable,
    load_sps_table_from_path,
)

from sglang_dspark import sps
from sglang_dspark.plugin.scheduling import SchedulerConfigError, apply_mode_env


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
        "tokens_per_request": (1, 2, 4, 8),
    }
    base.update(kw)
    return sps.SpsKey(**base)


def test_sweep_keeps_the_fewest_requests_for_each_batch_size():
    shapes = sps.sweep_shapes(16, [1, 2, 4, 8])
    by_b = {r * k: (r, k) for r, k in shapes}
    assert sorted(by_b) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert by_b[8] == (1, 8) and by_b[16] == (2, 8) and by_b[128] == (16, 8)
    assert len(shapes) == len(by_b)  # one shape per B
    assert sps.tokens_per_request_probes(8) == [1, 2, 4, 8]
    assert sps.tokens_per_request_probes(5) == [1, 2, 4, 5]


def test_table_is_one_over_the_median_step_time():
    table = sps.table_from_timings({4: [0.5, 0.25, 0.2], 1: [0.1, 0.1, 1.0]})
    assert table.sample_batch_tokens == [1, 4]
    assert table.sample_steps_per_sec == pytest.approx([10.0, 4.0])
    assert table.max_batch_tokens == 4
    with pytest.raises(ValueError):
        sps.table_from_timings({})
    noisy = sps.table_from_timings({1: [0.1], 2: [0.09], 4: [0.2]})  # B=2 timed faster than B=1
    assert noisy.sample_steps_per_sec == pytest.approx([10.0, 10.0, 5.0])


def test_time_sweep_runs_warmup_and_repeats_per_shape():
    calls = []
    out = sps.time_sweep(lambda r, k: calls.append((r, k)), [(1, 2), (2, 2)], repeats=3, warmup=1)
    assert calls == [(1, 2)] * 4 + [(2, 2)] * 4
    assert sorted(out) == [2, 4] and all(len(v) == 3 for v in out.values())


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


def test_startup_table_is_profiled_once_then_read_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    profiled = []

    def profile():
        profiled.append(1)
        return SpsCostTable(
            sample_batch_tokens=[1, 8], sample_steps_per_sec=[10.0, 8.0], max_batch_tokens=8
        )

    key = _key()
    t1, cached1, path = sps.table_at_startup(key, profile)
    t2, cached2, _ = sps.table_at_startup(key, profile)
    assert (cached1, cached2, len(profiled)) == (False, True, 1)
    assert t1 == t2
    assert path.parent == tmp_path / "sps"
    record = json.loads(path.read_text())
    assert record["key"]["dtype"] == "bfloat16" and record["table"]["sample_batch_tokens"] == [1, 8]
    # The bare table beside it is what --speculative-dspark-sps-table-path takes, read by SGLang.
    assert load_sps_table_from_path(str(sps.bare_table_path(key))) == t1
    # Another dtype is another table.
    sps.table_at_startup(_key(dtype="float32"), profile)
    assert len(profiled) == 2


def test_corrupt_cache_file_is_profiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    key = _key()
    sps.cache_path(key).parent.mkdir(parents=True)
    sps.cache_path(key).write_text("{not json")
    table, cached, _ = sps.table_at_startup(
        key,
        lambda: SpsCostTable(
            sample_batch_tokens=[1], sample_steps_per_sec=[3.0], max_batch_tokens=1
        ),
    )
    assert not cached and table.sample_steps_per_sec == [3.0]


def test_plot_writes_a_png(tmp_path):
    table = SpsCostTable(
        sample_batch_tokens=[1, 8, 64], sample_steps_per_sec=[10.0, 9.0, 4.0], max_batch_tokens=64
    )
    out = sps.plot_table(table, tmp_path / "sps.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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

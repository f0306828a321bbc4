"""benchmarks/soak.py's verdict (pure functions; the soak itself is a 10-minute benchmark)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _samples(f, n=61, every=10.0):
    return [{"t": i * every, "rss_mb": {"1 sglang::schedul": f(i * every), "2 python": 1250.0}}
            for i in range(n)]  # fmt: skip


STAGE = {"failures": 0, "requests": 210, "missing_usage": 0}


def test_a_steady_climb_fails_and_shows_in_the_last_third(soak):
    # 2 MB per 2.9 s, the scheduler's climb in the first recorded soak (1971 -> 2530 MB).
    samples = _samples(lambda t: 1971 + 560 * t / 600)
    v = soak.verdict_of(samples, STAGE, alive=True, locust_ok=True, max_growth_mb=64)
    assert not v["passed"]
    assert v["max_growth_second_half_mb"] == pytest.approx(280, rel=0.01)
    assert v["max_growth_last_third_mb"] == pytest.approx(560 * 200 / 600, rel=0.01)


def test_growth_that_stops_before_the_second_half_passes(soak):
    samples = _samples(lambda t: 1971 + min(t, 200) * 0.5)
    v = soak.verdict_of(samples, STAGE, alive=True, locust_ok=True, max_growth_mb=64)
    assert v["passed"]
    assert v["max_growth_second_half_mb"] == pytest.approx(0, abs=1e-6)
    assert v["max_growth_last_third_mb"] == pytest.approx(0, abs=1e-6)
    rss = soak.rss_summary(samples)["1 sglang::schedul"]
    assert rss == {"start": 1971.0, "end": 2071.0, "min": 1971.0, "max": 2071.0}


def test_the_sum_of_processes_is_bounded_too(soak):
    # Two processes each under the bound, together above it.
    samples = [{"t": i * 10.0, "rss_mb": {"1 a": 100 + i * 1.6, "2 b": 100 + i * 1.6}}
               for i in range(61)]  # fmt: skip
    grown = soak.growth(samples)
    assert grown["1 a"] < 64 and grown["2 b"] < 64 and grown[soak.SUM] > 64
    assert not soak.verdict_of(samples, STAGE, alive=True, locust_ok=True, max_growth_mb=64)[
        "passed"
    ]


def test_no_load_test_summary_or_a_failed_request_fails(soak):
    samples = _samples(lambda t: 2000.0)
    ok = {"alive": True, "locust_ok": True, "max_growth_mb": 64}
    assert soak.verdict_of(samples, STAGE, **ok)["passed"]
    assert not soak.verdict_of(samples, None, **ok)["passed"]
    assert not soak.verdict_of(samples, {**STAGE, "failures": 1}, **ok)["passed"]
    assert not soak.verdict_of(samples, STAGE, **{**ok, "alive": False})["passed"]
    assert not soak.verdict_of(samples, STAGE, **{**ok, "locust_ok": False})["passed"]
    assert not soak.verdict_of(samples[:1], STAGE, **ok)["passed"]  # nothing to fit


def test_env_pairs(soak):
    assert soak.parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        soak.parse_env(["NOVALUE"])
    base = {"MALLOC_MMAP_THRESHOLD_": "1048576", "KEEP": "1"}
    assert soak.server_env(base, {"MALLOC_MMAP_THRESHOLD_": "", "A": "2"}) == {
        "KEEP": "1",
        "A": "2",
    }


def test_cpu_seconds_per_output_token(soak):
    samples = [{"t": 0.0, "rss_mb": {}, "cpu_s": {"1 a": 10.0, "2 b": 1.0}},
               {"t": 60.0, "rss_mb": {}, "cpu_s": {"1 a": 70.0, "2 b": 5.0, "3 new": 2.0}}]  # fmt: skip
    assert soak.cpu_per_token(samples, 320) == pytest.approx((60 + 4) / 320)
    assert soak.cpu_per_token(samples, 0) is None
    assert soak.cpu_per_token([{"t": 0.0, "rss_mb": {}}] * 2, 320) is None  # older samples

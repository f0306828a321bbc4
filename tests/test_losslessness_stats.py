"""The statistics behind the losslessness tests and `sglang-dspark audit`, without a server.

- a comparison with nothing random in it fails, with the reason, instead of passing vacuously;
- the joint test over whole short continuations sees a change in how consecutive tokens
  depend on each other that leaves every per-position marginal exactly intact;
- the stated power (`detectable_tv`) is what a simulation of the test measures.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from sglang_dspark.verification.losslessness import compare_samples, detectable_tv


def test_no_test_run_fails_and_says_why():
    # every sample is the same continuation: one category at every position
    same = [[[5, 6, 7, 8]] * 50]
    report = compare_samples(same, same, [1, 2, 3], joint_positions=(0, 1, 2))
    assert report.tests == []
    assert not report.passed
    text = report.summary()  # must not crash on an empty min
    assert text.startswith("FAIL") and "no test could run" in text and "single category" in text
    assert report.min_p is None and report.detectable_tv() is None


def test_identical_distributions_pass_and_report_power():
    rng = np.random.default_rng(0)
    probs = [0.4, 0.3, 0.2, 0.1]

    def draw():
        return [rng.choice(4, size=(300, 3), p=probs).tolist() for _ in range(2)]

    report = compare_samples(draw(), draw(), [0, 1, 2], joint_positions=(0, 1), alpha=0.01)
    assert len(report.tests) == 2 * 4  # 3 positions + 1 joint per prompt
    assert report.passed, report.summary()
    assert "detects with power 0.8: per position TV >= " in report.summary()
    assert report.detectable_tv(joint=True) > report.detectable_tv(joint=False)  # more categories


def test_joint_test_catches_a_dependence_the_marginals_cannot_see():
    """Reference: two independent fair coins. Test: the second copies the first. Marginals
    are identical in distribution; only the joint category (x0, x1) differs."""
    rng = np.random.default_rng(1)
    n = 400
    ref = rng.integers(0, 2, size=(n, 2))
    first = rng.integers(0, 2, size=n)
    test = np.stack([first, first], 1)
    marginal = compare_samples([test.tolist()], [ref.tolist()], [0, 1], alpha=0.01)
    assert marginal.passed, marginal.summary()
    joint = compare_samples([test.tolist()], [ref.tolist()], [0, 1], joint_positions=(0, 1))
    assert not joint.passed
    assert "joint position 0+1" in joint.summary()


def _power(p: np.ndarray, q: np.ndarray, n: int, level: float, reps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    a = rng.multinomial(n, p, size=reps)
    b = rng.multinomial(n, q, size=reps)
    hits = 0
    for x, y in zip(a, b):
        keep = (x + y) > 0
        hits += chi2_contingency([x[keep], y[keep]], correction=False)[1] < level
    return hits / reps


@pytest.mark.parametrize("k", [2, 4, 8])
def test_detectable_tv_is_the_measured_power(k):
    """At the stated TV, shifted in the least favourable direction (mass moved proportionally
    from half the categories to the other half), the simulated test detects about 80% of the
    time; at half that TV far less often; a shift of the same TV concentrated on one category
    is detected at least as often (the statement holds whatever the direction)."""
    n, level, reps = 240, 0.01 / 12, 600
    q = np.full(k, 1 / k)
    tv = detectable_tv(n, n, k - 1, level, power=0.8)
    assert 0.1 < tv < 0.4  # about 0.2 at this sample size
    sign = np.where(np.arange(k) < k // 2, 1.0, -1.0)

    def least_favourable(delta):
        return q + delta * q * sign / 0.5

    measured = _power(least_favourable(tv), q, n, level, reps, seed=k)
    assert 0.72 <= measured <= 0.88, measured
    assert _power(least_favourable(tv / 2), q, n, level, reps, seed=k + 1) < 0.35
    concentrated = q.copy()
    concentrated[0] += tv
    concentrated[1:] -= tv / (k - 1)
    assert _power(concentrated, q, n, level, reps, seed=k + 2) >= 0.75


def test_detectable_tv_shrinks_as_one_over_root_n():
    small = detectable_tv(240, 240, 5, 1e-3)
    large = detectable_tv(960, 960, 5, 1e-3)
    assert large == pytest.approx(small / 2, rel=1e-6)
    with pytest.raises(ValueError, match="samples on both sides"):
        detectable_tv(0, 240, 5, 1e-3)

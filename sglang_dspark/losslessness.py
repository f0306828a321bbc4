"""Statistical check that speculative sampling leaves the output distribution unchanged.

Two samples of generated sequences (one from the server under test, one from the reference:
the same server without speculation) are compared position by position with a chi-square test
of homogeneity. Categories seen fewer than `min_count` times in the pooled sample are merged
into one "other" bin so that the chi-square approximation holds. The family-wise false-alarm
rate is `alpha`, split over all (prompt, position) tests (Bonferroni).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from scipy.stats import chi2_contingency


@dataclass(frozen=True)
class PositionTest:
    prompt: int
    position: int  # 0-based index in the generated tokens
    statistic: float
    dof: int
    p_value: float


@dataclass(frozen=True)
class LosslessnessReport:
    alpha: float
    tests: list[PositionTest]

    @property
    def threshold(self) -> float:
        return self.alpha / max(len(self.tests), 1)

    @property
    def passed(self) -> bool:
        return all(t.p_value >= self.threshold for t in self.tests)

    @property
    def min_p(self) -> float:
        return min(t.p_value for t in self.tests)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: {len(self.tests)} chi-square tests, family-wise false-alarm rate "
            f"{self.alpha} (per test {self.threshold:.2g}), smallest p = {self.min_p:.3g}"
        )


def _table(a: list[int], b: list[int], min_count: int) -> list[list[int]]:
    ca, cb = Counter(a), Counter(b)
    pooled = ca + cb
    keep = sorted(k for k, v in pooled.items() if v >= min_count)
    rows = [[ca[k] for k in keep], [cb[k] for k in keep]]
    other_a = sum(v for k, v in ca.items() if k not in keep)
    other_b = sum(v for k, v in cb.items() if k not in keep)
    if other_a + other_b > 0:
        rows[0].append(other_a)
        rows[1].append(other_b)
    return rows


def compare_samples(
    test: list[list[list[int]]],
    reference: list[list[list[int]]],
    positions: list[int],
    *,
    alpha: float = 0.01,
    min_count: int = 10,
) -> LosslessnessReport:
    """test[p][s] / reference[p][s]: generated token ids of sample s for prompt p."""
    results = []
    for p, (ta, ra) in enumerate(zip(test, reference)):
        for pos in positions:
            a = [seq[pos] for seq in ta if len(seq) > pos]
            b = [seq[pos] for seq in ra if len(seq) > pos]
            table = _table(a, b, min_count)
            if len(table[0]) < 2:
                continue  # one category only: nothing to compare
            stat, p_value, dof, _ = chi2_contingency(table)
            results.append(PositionTest(p, pos, float(stat), int(dof), float(p_value)))
    return LosslessnessReport(alpha, results)

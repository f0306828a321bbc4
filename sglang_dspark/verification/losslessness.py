"""Statistical check that speculative sampling leaves the output distribution unchanged.

Two samples of generated sequences (one from the server under test, one from the reference:
the same server without speculation) are compared with chi-square tests of homogeneity:

- per prompt and generated position, the distribution of the token at that position;
- per prompt, the joint distribution of a whole short continuation (the tuple of tokens at
  `joint_positions`), which also sees errors in how consecutive tokens depend on each other
  that leave every marginal intact.

Categories seen fewer than `min_count` times in the pooled sample are merged into one "other"
bin, so that the chi-square approximation holds (with equal sample sizes every expected cell
count is then at least min_count / 2). The family-wise false-alarm rate is `alpha`, split over
all tests (Bonferroni).

A report with no test (every compared position had one category only: nothing was random) is
a FAIL, never a vacuous pass. Each test also states its power: the smallest total-variation
distance between the two (pooled) distributions that it detects with probability `power` at
its level, whatever the direction of the shift (`detectable_tv`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from scipy.optimize import brentq
from scipy.stats import chi2, chi2_contingency, ncx2


@dataclass(frozen=True)
class CategoryTest:
    prompt: int
    positions: tuple[int, ...]  # 0-based indices in the generated tokens; >1 = joint test
    statistic: float
    dof: int
    p_value: float
    n_test: int
    n_reference: int

    @property
    def joint(self) -> bool:
        return len(self.positions) > 1

    def label(self) -> str:
        where = "+".join(str(p) for p in self.positions)
        return f"prompt {self.prompt} {'joint ' if self.joint else ''}position {where}"


PositionTest = CategoryTest  # the name of the per-position test before joint tests existed


def detectable_tv(
    n_test: int, n_reference: int, dof: int, level: float, power: float = 0.8
) -> float:
    """Smallest total-variation shift a 2 x (dof + 1) chi-square homogeneity test at `level`
    detects with probability `power`, in the least favourable direction.

    Under an alternative with test distribution p and reference q, the statistic is
    asymptotically noncentral chi-square with dof degrees of freedom and noncentrality
    lambda = n1 n2 / (n1 + n2) * sum_i (p_i - q_i)^2 / m_i, m_i the pooled probabilities.
    For a fixed TV(p, q) = delta, sum_i d_i^2 / m_i is smallest when the shift moves mass
    proportionally from a set of total probability 1/2 to its complement, where it equals
    4 delta^2; so every shift of TV >= delta has lambda >= 4 delta^2 n1 n2 / (n1 + n2). We find
    the lambda at which the power reaches `power` and invert.
    """
    if n_test <= 0 or n_reference <= 0 or dof <= 0:
        raise ValueError(
            f"need samples on both sides and dof >= 1 (got {n_test}, {n_reference}, {dof})"
        )
    critical = chi2.isf(level, dof)
    lam = brentq(lambda x: ncx2.sf(critical, dof, x) - power, 1e-9, 1e5)
    return math.sqrt(lam * (n_test + n_reference) / (4 * n_test * n_reference))


@dataclass(frozen=True)
class LosslessnessReport:
    alpha: float
    tests: list[CategoryTest]
    power: float = 0.8
    skipped: list[str] = field(default_factory=list)  # comparisons with a single category

    @property
    def threshold(self) -> float:
        return self.alpha / max(len(self.tests), 1)

    @property
    def failures(self) -> list[CategoryTest]:
        return [t for t in self.tests if t.p_value < self.threshold]

    @property
    def passed(self) -> bool:
        return bool(self.tests) and not self.failures

    @property
    def min_p(self) -> float | None:
        return min((t.p_value for t in self.tests), default=None)

    def detectable_tv(self, joint: bool | None = None) -> float | None:
        """The largest (worst) `detectable_tv` over the tests (only joint or per-position ones
        when `joint` says so): a shift at least this large at ANY one tested prompt and
        position is detected with probability >= `power` at the family-wise level."""
        chosen = [t for t in self.tests if joint is None or t.joint == joint]
        if not chosen:
            return None
        return max(
            detectable_tv(t.n_test, t.n_reference, t.dof, self.threshold, self.power)
            for t in chosen
        )

    def summary(self) -> str:
        if not self.tests:
            return (
                f"FAIL: no test could run: all {len(self.skipped)} compared positions had a single "
                "category in the pooled samples (nothing random to compare); sample at "
                "temperature 1, more samples or longer continuations"
            )
        verdict = "PASS" if self.passed else "FAIL"
        joint = sum(t.joint for t in self.tests)
        text = (
            f"{verdict}: {len(self.tests) - joint} per-position and {joint} joint chi-square "
            f"tests, family-wise false-alarm rate {self.alpha} (per test {self.threshold:.2g}), "
            f"smallest p = {self.min_p:.3g}"
        )
        power = []
        for name, kind in [("per position", False), ("joint", True)]:
            tv = self.detectable_tv(kind)
            if tv is not None:
                power.append(f"{name} TV >= {tv:.3f}")
        text += f"; detects with power {self.power}: " + ", ".join(power)
        if self.failures:
            worst = sorted(self.failures, key=lambda t: t.p_value)[:3]
            text += "; differs at " + ", ".join(f"{t.label()} (p = {t.p_value:.2g})" for t in worst)
        return text


def _table(a: Sequence[Hashable], b: Sequence[Hashable], min_count: int) -> list[list[int]]:
    ca, cb = Counter(a), Counter(b)
    pooled = ca + cb
    keep = sorted((k for k, v in pooled.items() if v >= min_count), key=repr)
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
    joint_positions: Sequence[int] | None = None,
    alpha: float = 0.01,
    min_count: int = 10,
    power: float = 0.8,
) -> LosslessnessReport:
    """test[p][s] / reference[p][s]: generated token ids of sample s for prompt p.

    One test per prompt and position in `positions`; with `joint_positions`, one more per
    prompt on the tuple of tokens at those positions (samples shorter than the last one are
    left out of that test)."""
    if len(test) != len(reference):
        raise ValueError(
            f"{len(test)} prompts sampled from the server, {len(reference)} from the reference"
        )
    groups = [(pos,) for pos in positions]
    if joint_positions:
        groups.append(tuple(joint_positions))
    results, skipped = [], []
    for p, (ta, ra) in enumerate(zip(test, reference)):
        for group in groups:
            last = max(group)
            a = [tuple(seq[i] for i in group) for seq in ta if len(seq) > last]
            b = [tuple(seq[i] for i in group) for seq in ra if len(seq) > last]
            table = _table(a, b, min_count)
            if len(table[0]) < 2 or not a or not b:
                skipped.append(f"prompt {p} positions {group}")
                continue  # one category only: nothing to compare
            stat, p_value, dof, _ = chi2_contingency(table, correction=False)
            results.append(
                CategoryTest(p, group, float(stat), int(dof), float(p_value), len(a), len(b))
            )
    return LosslessnessReport(alpha, results, power, skipped)

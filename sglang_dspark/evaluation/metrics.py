"""Acceptance metrics: tau, acceptance rate, position-wise acceptance, threshold sweep.

All are functions of the recorded rounds: n (drafts accepted, 0..gamma) and the raw
confidences c_1..c_gamma of each round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_dspark.evaluation.benchmarks import DOMAINS
from sglang_dspark.evaluation.decoding import Generation

DEFAULT_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den > 0 else None


def acceptance_metrics(accepted: np.ndarray, gamma: int) -> dict[str, Any]:
    """tau, acceptance rate and position-wise acceptance from accept lengths n [R].

    reach[k] = P(n >= k) (drafts 1..k all accepted); conditional[k] = P(n >= k | n >= k-1),
    so mean tau = 1 + sum_k reach[k] = 1 + sum_k prod_{i<=k} conditional[i].
    """
    n = np.asarray(accepted, dtype=np.int64)
    R = int(n.size)
    ge = [int((n >= k).sum()) for k in range(gamma + 1)]  # ge[0] = R
    return {
        "rounds": R,
        "tau": _ratio(n.sum() + R, R),
        "acceptance_rate": _ratio(n.sum(), R * gamma),
        "position_acceptance": [_ratio(ge[k], ge[k - 1]) for k in range(1, gamma + 1)],
        "reach_probability": [_ratio(ge[k], R) for k in range(1, gamma + 1)],
        "accept_length_histogram": [int((n == k).sum()) for k in range(gamma + 1)],
    }


def verified_lengths(confidence: np.ndarray, threshold: float) -> np.ndarray:
    """Drafts verified per round: the block is cut before the first k with
    a_k = prod_{i<=k} c_i < threshold (the anchor is always verified)."""
    survival = np.cumprod(np.asarray(confidence, dtype=np.float64), axis=1)
    return np.cumprod(survival >= threshold, axis=1).sum(axis=1)


def threshold_sweep(
    accepted: np.ndarray, confidence: np.ndarray, thresholds: Sequence[float]
) -> list[dict[str, Any]]:
    """Static confidence-threshold sweep over recorded rounds (n [R], c [R, gamma]).

    A round truncated to l drafts accepts min(n, l): acceptance of draft k given 1..k-1
    does not depend on what follows k, and l depends on drafts 1..l+1 only through c.
    acceptance_rate = accepted / verified drafts; tau = mean tokens per round;
    tau_per_verified = tokens produced per verified token (anchor included).
    """
    n = np.asarray(accepted, dtype=np.int64)
    out = []
    for t in thresholds:
        ln = verified_lengths(confidence, float(t)) if n.size else np.zeros(0, np.int64)
        got = np.minimum(n, ln)
        out.append(
            {
                "threshold": float(t),
                "verified_drafts": _ratio(ln.sum(), n.size),
                "acceptance_rate": _ratio(got.sum(), ln.sum()),
                "tau": _ratio(got.sum() + n.size, n.size),
                "tau_per_verified": _ratio(got.sum() + n.size, ln.sum() + n.size),
            }
        )
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass
class RunRecord:
    """Every round of one (benchmark, temperature) cell, plus timing."""

    benchmark: str
    temperature: float
    accepted: list[int] = field(default_factory=list)
    confidence_logits: list[list[float]] = field(default_factory=list)
    prompts: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    baseline_tokens: int = 0
    baseline_s: float = 0.0
    per_prompt: list[tuple[int, int]] = field(default_factory=list)  # (accepted, rounds)

    def add(self, gen: Generation) -> None:
        self.prompts += 1
        self.per_prompt.append((sum(r.accepted for r in gen.rounds), len(gen.rounds)))
        self.generated_tokens += len(gen.tokens)
        for r in gen.rounds:
            self.accepted.append(r.accepted)
            if r.confidence_logits is not None:
                self.confidence_logits.append(r.confidence_logits)
        for k in ("wall_s", "draft_s", "verify_s", "prefill_s"):
            setattr(self, k, getattr(self, k) + getattr(gen, k))


def summarize(
    records: Sequence[RunRecord], gamma: int, thresholds: Sequence[float]
) -> dict[str, Any]:
    """Metrics of the rounds of ``records`` pooled together."""
    n = np.array([x for r in records for x in r.accepted], dtype=np.int64)
    out = acceptance_metrics(n, gamma)
    have_conf = n.size > 0 and all(len(r.confidence_logits) == len(r.accepted) for r in records)
    if have_conf:
        conf = _sigmoid(np.array([c for r in records for c in r.confidence_logits]))
        out["mean_confidence"] = conf.mean(axis=0).tolist()
        out["sweep"] = threshold_sweep(n, conf, thresholds)
    else:
        out["mean_confidence"] = None
        out["sweep"] = None
    tokens = sum(r.generated_tokens for r in records)
    wall = sum(r.wall_s for r in records)
    out.update(
        prompts=sum(r.prompts for r in records),
        generated_tokens=tokens,
        wall_s=wall,
        prefill_s=sum(r.prefill_s for r in records),
        draft_s=sum(r.draft_s for r in records),
        verify_s=sum(r.verify_s for r in records),
        tokens_per_s=_ratio(tokens, wall),
    )
    base_s = sum(r.baseline_s for r in records)
    if base_s > 0:
        base_tps = sum(r.baseline_tokens for r in records) / base_s
        out["baseline_tokens_per_s"] = base_tps
        out["speedup_vs_target"] = _ratio(out["tokens_per_s"] or 0.0, base_tps)
    return out


def build_results(
    records: Sequence[RunRecord],
    gamma: int,
    thresholds: Sequence[float],
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """results[T] = {benchmarks: {name: m}, domains: {domain: m}, overall: m}."""
    results: dict[str, Any] = {}
    for temp in dict.fromkeys(r.temperature for r in records):
        at_t = [r for r in records if r.temperature == temp]
        domains: dict[str, list[RunRecord]] = {}
        for r in at_t:
            domains.setdefault(DOMAINS.get(r.benchmark, r.benchmark), []).append(r)
        results[f"{temp:g}"] = {
            "temperature": temp,
            "benchmarks": {r.benchmark: summarize([r], gamma, thresholds) for r in at_t},
            "domains": {d: summarize(rs, gamma, thresholds) for d, rs in domains.items()},
            "overall": summarize(at_t, gamma, thresholds),
        }
    return {"config": config or {}, "gamma": gamma, "results": results}

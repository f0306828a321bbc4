"""Hardware-aware prefix scheduler (DSPARK.md section 3): how many drafts each request verifies.

Pure torch and batched: every function takes the confidences of all R requests at once,
c [R, gamma] with c[r, j-1] = P(draft j of request r survives | drafts 1..j-1 survived)
(already STS-calibrated), and returns verify lengths l [R] in 0..gamma: the number of drafts
request r verifies besides its anchor. SGLang's `verify_lens` are 1 + l.

Symbols, as in the paper:
    a[r, j]  = prod_{i<=j} c[r, i]                 survival of the prefix 1..j
    B        = sum_r (1 + l_r)                     verify batch tokens
    tau      = sum_r (1 + sum_{j<=l_r} a[r, j])    expected tokens out of the step
    Theta    = tau * SPS(B)                        expected token throughput
SPS(B) (engine steps per second at B batch tokens) comes from SGLang's own cost-table files,
`SpsCostTable` (floor lookup) or `SpsAdditiveCostTable`, read with SGLang's classes.

Three schedulers:
- `schedule_sync`: Algorithm 1. Sort every candidate (r, j) by a descending and walk the list,
  admitting a candidate while Theta strictly improves; STOP at the first non-improvement. The
  early stop is what makes it lossless: whether (r, j) is reached depends only on
  candidates with larger survival, hence only on drafts before j of request r (a[r, j+1] can
  depend on draft j, but it never comes before (r, j)).
- `schedule_async`: the production variant SGLang ships. The capacity K (extra verify tokens)
  is the unconstrained argmax of Theta over ALL prefixes of the sorted order, computed from
  confidences of two steps earlier; the current step then takes the top-K current candidates.
  K cannot depend on the current drafts, so the search may jump over SPS cliffs.
- `schedule_static`: verify while a >= threshold (diagnosis; no cost table).

Taking the argmax over all prefixes with CURRENT confidences (`schedule_async(c, c, sps)`) is
NOT lossless (Appendix A counterexample, tests/test_scheduler.py); it exists only as that.
"""

from __future__ import annotations

from pathlib import Path

import torch
from sglang.srt.speculative.dspark_components.dspark_sps import (
    SpsAdditiveCostTable,
    SpsCostTable,
    load_sps_table_from_path,
)

SpsTable = SpsCostTable | SpsAdditiveCostTable

__all__ = [
    "SpsTable",
    "expected_throughput",
    "greedy_path",
    "load_sps_table",
    "save_sps_table",
    "schedule_async",
    "schedule_static",
    "schedule_sync",
    "sps_table_from_points",
    "steps_per_sec",
    "survival",
    "sync_may_verify",
    "top_k_lengths",
    "verify_capacity",
]


# ---------------------------------------------------------------------------------------------
# SPS cost table


def load_sps_table(path: str | Path) -> SpsTable:
    """SGLang's SPS file (`--speculative-dspark-sps-table-path`), read by SGLang's loader."""
    return load_sps_table_from_path(str(path))


def sps_table_from_points(batch_tokens: list[int], steps_per_sec: list[float]) -> SpsCostTable:
    """A floor-lookup `SpsCostTable` from profiled (batch tokens, steps/s) points."""
    order = sorted(range(len(batch_tokens)), key=lambda i: batch_tokens[i])
    xs = [int(batch_tokens[i]) for i in order]
    return SpsCostTable(
        sample_batch_tokens=xs,
        sample_steps_per_sec=[float(steps_per_sec[i]) for i in order],
        max_batch_tokens=xs[-1],
    )


def save_sps_table(table: SpsTable, path: str | Path) -> None:
    Path(path).write_text(table.to_json(), encoding="utf-8")


def _interp_clamped(xs: list[int], ys: list[float], x: torch.Tensor) -> torch.Tensor:
    """Vectorised `dspark_sps._interp_clamped`: linear between probes, flat outside."""
    px = torch.tensor(xs, dtype=torch.float64)
    py = torch.tensor(ys, dtype=torch.float64)
    if px.numel() == 1:
        return py.expand_as(x).clone()
    x = x.clamp(min=float(xs[0]), max=float(xs[-1]))
    hi = torch.bucketize(x, px, right=True).clamp_(1, px.numel() - 1)
    lo = hi - 1
    frac = (x - px[lo]) / (px[hi] - px[lo])
    return py[lo] + frac * (py[hi] - py[lo])


def steps_per_sec(table: SpsTable, batch_tokens: torch.Tensor, num_requests: int) -> torch.Tensor:
    """SPS(B) for a tensor of batch-token counts B (float64), exactly as SGLang's planner.

    `SpsCostTable`: the value at the largest probe <= B (the first probe below it).
    `SpsAdditiveCostTable`: 1 / (bias + alpha(R) + theta(B)), both interpolated and clamped;
    it is the only kind where the number of requests R matters.
    """
    b = batch_tokens.to(device="cpu", dtype=torch.int64)  # tables are host-side, as in SGLang
    if isinstance(table, SpsAdditiveCostTable):
        floor = table.bias_seconds + _interp_clamped(
            table.bs_probes, table.alpha_seconds, torch.tensor([float(num_requests)])
        )
        step = floor + _interp_clamped(table.m_probes, table.theta_seconds, b.to(torch.float64))
        return (1.0 / step).to(batch_tokens.device)
    probes = torch.tensor(table.sample_batch_tokens, dtype=torch.int64)
    values = torch.tensor(table.sample_steps_per_sec, dtype=torch.float64)
    idx = (torch.bucketize(b, probes, right=True) - 1).clamp_(0, probes.numel() - 1)
    return values[idx].to(batch_tokens.device)


# ---------------------------------------------------------------------------------------------
# The greedy order shared by every scheduler


def survival(c: torch.Tensor) -> torch.Tensor:
    """a[r, j] = prod_{i<=j} c[r, i], in float64."""
    if c.dim() != 2:
        raise ValueError(f"confidences must be [R, gamma], got shape {tuple(c.shape)}")
    return torch.cumprod(c.to(torch.float64).clamp(0.0, 1.0), dim=1)


def _greedy_order(a: torch.Tensor) -> torch.Tensor:
    """Flat indices (r * gamma + j) of the candidates with a > 0, in path order: a descending,
    ties to the lower position, then the lower request."""
    R, gamma = a.shape
    flat = a.reshape(-1)
    pos = torch.arange(gamma, device=a.device).repeat(R)
    # Row-major order is already by request; two stable sorts make it by value, then
    # position, then request (SGLang's top-K kernel orders the same way).
    order = torch.arange(flat.numel(), device=a.device)
    order = order[torch.argsort(pos[order], stable=True)]
    order = order[torch.argsort(-flat[order], stable=True)]
    return order[flat[order] > 0]


def greedy_path(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates (r, j) with a[r, j] > 0, sorted by a descending.

    Ties go to the lower position, then the lower request, so each request's positions appear
    in prefix order. Returns (survival values, request index) along the path, each [N].
    """
    order = _greedy_order(a)
    return a.reshape(-1)[order], order // a.shape[1]


def _lengths_from_path(req_on_path: torch.Tensor, take: int, R: int) -> torch.Tensor:
    """Verify lengths when the first `take` candidates of the path are admitted."""
    dev = req_on_path.device
    lengths = torch.zeros(R, dtype=torch.int64, device=dev)
    return lengths.scatter_add_(
        0, req_on_path[:take], torch.ones(take, dtype=torch.int64, device=dev)
    )


def _path_theta(a_path: torch.Tensor, R: int, sps: SpsTable) -> torch.Tensor:
    """Theta after admitting the first i candidates, i = 0..N ([N + 1]; i = 0: anchors only)."""
    start = torch.tensor([float(R)], dtype=torch.float64, device=a_path.device)
    tau = torch.cumsum(torch.cat([start, a_path]), 0)
    batch = R + torch.arange(tau.numel(), dtype=torch.int64, device=a_path.device)
    return tau * steps_per_sec(sps, batch, R)


# ---------------------------------------------------------------------------------------------
# Schedulers


def schedule_sync(c: torch.Tensor, sps: SpsTable) -> torch.Tensor:
    """Algorithm 1: greedy walk along the path with early stop. Returns l [R] (int64).

    B = R, tau = R, Theta_best = R * SPS(R); for each candidate (r, j) in order:
    l_r = j, B += 1, tau += a[r, j]; keep it if Theta > Theta_best, else STOP.
    Each kept candidate raises Theta_best, so the kept set is the longest prefix of the path
    along which Theta is strictly increasing: a cumulative product of "improves" flags.
    """
    R = c.shape[0]
    a_path, req_path = greedy_path(survival(c))
    theta = _path_theta(a_path, R, sps)
    improves = theta[1:] > theta[:-1]
    take = int(torch.cumprod(improves.to(torch.int64), 0).sum())
    return _lengths_from_path(req_path, take, R)


def sync_may_verify(c_known: torch.Tensor, sps: SpsTable) -> bool:
    """Whether Algorithm 1 verifies a draft at position k for some request, from the
    confidences of positions 0..k alone (`c_known` [R, k + 1]). The draft pass asks before it
    drafts position k (`cpu_draft_until_verifiable`): the confidence of position k needs only
    the drafts before it.

    Exact, not a bound: every candidate at a later position has survival at most its request's
    a[r, k], and the greedy order puts the lower position first among equals, so the first
    position-k candidate on the path comes before every candidate not yet known. Walking the
    known path up to it decides whether Algorithm 1 admits it (then request r verifies position
    k) or stops on or before it (then no request verifies position k or any later one,
    whatever the later drafts are).
    """
    a = survival(c_known)
    R, K = a.shape
    order = _greedy_order(a)
    first = ((order % K) == K - 1).nonzero()
    if not len(first):  # every position-k survival is 0: never on the path
        return False
    theta = _path_theta(a.reshape(-1)[order[: int(first[0]) + 1]], R, sps)
    return bool((theta[1:] > theta[:-1]).all())


def verify_capacity(c_lagged: torch.Tensor, sps: SpsTable) -> int:
    """K: extra verify tokens maximising Theta over every prefix of the path (no early stop).

    Same as SGLang's `compute_verify_token_budget`; the first maximum wins on ties.
    Lossless only when `c_lagged` cannot depend on the drafts being verified.
    """
    a_path, _ = greedy_path(survival(c_lagged))
    return int(torch.argmax(_path_theta(a_path, c_lagged.shape[0], sps)))


def top_k_lengths(c: torch.Tensor, k: int) -> torch.Tensor:
    """Admit the first k candidates of the path (fewer if fewer have a > 0). Returns l [R]."""
    a_path, req_path = greedy_path(survival(c))
    return _lengths_from_path(req_path, min(max(int(k), 0), a_path.numel()), c.shape[0])


def schedule_async(c_lagged: torch.Tensor, c_now: torch.Tensor, sps: SpsTable) -> torch.Tensor:
    """The asynchronous variant: K from two-steps-earlier confidences, top-K of the current ones.

    `c_lagged` [R, gamma] is aligned with the current requests (SGLang feeds ones for a
    request without a fresh history, which makes its candidates rank first).
    """
    if c_lagged.shape != c_now.shape:
        raise ValueError(
            f"c_lagged {tuple(c_lagged.shape)} and c_now {tuple(c_now.shape)} must both be "
            "[R, gamma] for the same requests; pass ones for requests without history"
        )
    return top_k_lengths(c_now, verify_capacity(c_lagged, sps))


def schedule_static(c: torch.Tensor, threshold: float) -> torch.Tensor:
    """Diagnosis mode: verify drafts while the cumulative survival a >= threshold."""
    keep = (survival(c) >= float(threshold)).to(torch.int64)
    return torch.cumprod(keep, dim=1).sum(dim=1)


def expected_throughput(c: torch.Tensor, lengths: torch.Tensor, sps: SpsTable) -> float:
    """Theta = tau * SPS(B) for given verify lengths (the quantity the schedulers maximise)."""
    a = survival(c)
    R, gamma = a.shape
    mask = torch.arange(gamma, device=a.device)[None, :] < lengths.to(a.device)[:, None]
    tau = R + float((a * mask).sum())
    batch = torch.tensor([R + int(lengths.sum())])
    return tau * float(steps_per_sec(sps, batch, R)[0])

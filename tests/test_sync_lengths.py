"""`sync`'s per-request lengths travel with their step: each step's confidence tensor carries
Algorithm 1's lengths from the budget to the layout (``plugin/scheduling.py``), so two batches
whose steps interleave (two scheduler loops, or a budget computed before another batch's
layout) each verify their own lengths, and a layout asked for another budget falls back to
SGLang's top-K."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dspark.plugin import scheduling
from sglang_dspark.scheduling.scheduler import schedule_sync


@pytest.fixture
def sync_mode(monkeypatch):
    monkeypatch.setenv("SGLANG_DSPARK_SCHEDULER", "sync")


def _planner():
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig
    from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable

    table = SpsCostTable(sample_batch_tokens=[1, 2, 3, 4, 6, 16],
                         sample_steps_per_sec=[10.0, 10.0, 9.5, 9.0, 6.0, 3.0],
                         max_batch_tokens=16)  # fmt: skip
    cfg = DSparkScheduleConfig(gamma=4)
    return SimpleNamespace(forced_budget_frac=None, sps_table=table, cfg=cfg, last_decision=None)


def _budget(planner, confidence):
    """The budget of one step through both hooks, as SGLang calls them: the verify planner's
    compute_budget_sync hands the budget planner a CPU copy of the step's confidences."""

    def upstream_budget_sync(verify_planner, *, confidence, prefix_lens, req_pool_indices):
        copy = confidence.clone()  # what `.to("cpu")` gives a CUDA tensor: another object
        return scheduling._compute_budget_sync(
            lambda *a, **k: pytest.fail("sync mode must not reach upstream's budget"),
            planner, confidence=copy, generation=None, current_generation=None,
            req_pool_indices_cpu=req_pool_indices,
        )  # fmt: skip

    return scheduling._budget_sync_on_step(
        upstream_budget_sync, None, confidence=confidence, prefix_lens=None,
        req_pool_indices=torch.arange(confidence.shape[0]),
    )  # fmt: skip


def _layout(planner, confidence, budget):
    return scheduling._topk_with_sync_lengths(
        lambda cls, **k: "upstream top-K", None, confidence=confidence, budget=budget,
        cfg=planner.cfg,
    )  # fmt: skip


def test_interleaved_batches_each_verify_their_own_lengths(sync_mode):
    planner = _planner()
    a = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.9, 0.1, 0.9, 0.9]], dtype=torch.float32)
    b = torch.tensor([[0.95, 0.95, 0.95, 0.2], [0.3, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]])
    budget_a, budget_b = _budget(planner, a), _budget(planner, b)  # both before either layout
    want_a, want_b = (
        schedule_sync(a.double(), planner.sps_table),
        schedule_sync(b.double(), planner.sps_table),
    )
    assert budget_a == int(want_a.sum()) and budget_b == int(want_b.sum())
    assert not torch.equal(want_a, want_b[:2])  # the two steps differ: mixing them would show
    lens_b = _layout(planner, b, budget_b)
    lens_a = _layout(planner, a, budget_a)
    assert lens_a.tolist() == scheduling.sync_verify_lens(want_a, planner.cfg).tolist()
    assert lens_b.tolist() == scheduling.sync_verify_lens(want_b, planner.cfg).tolist()
    # a layout for another budget (e.g. raised to fill a CUDA-graph tier) is upstream's
    assert _layout(planner, a, budget_a + 1) == "upstream top-K"
    # confidences that no sync budget was computed for: upstream's
    assert _layout(planner, a.clone(), budget_a) == "upstream top-K"


def test_async_mode_carries_nothing(monkeypatch):
    monkeypatch.setenv("SGLANG_DSPARK_SCHEDULER", "async")
    planner = _planner()
    c = torch.tensor([[0.9, 0.9, 0.9, 0.9]])
    got = scheduling._compute_budget_sync(
        lambda p, **k: 3, planner, confidence=c, generation=None, current_generation=None,
        req_pool_indices_cpu=torch.arange(1),
    )  # fmt: skip
    assert got == 3 and not hasattr(c, scheduling.SYNC_ATTR)
    assert _layout(planner, c, 3) == "upstream top-K"

"""Negative controls in pure torch: which broken samplers the audit's tests catch, at what size.

A synthetic target and draft (order-1 Markov chains over 48 tokens, the draft a noisy copy of
the target: acceptance about 0.72, top-1 probability about 0.5) are decoded speculatively by
`chain_speculative_sampling_torch`, the function the server's `cpu_rejection_sampler` hook
runs, with each `SGLANG_DSPARK_TEST_BREAK_SAMPLER` mode; the continuations go through the
audit's own comparison (`compare_samples`, positions 1..3 and the joint first 3 tokens, three
prompts, family-wise alpha 0.01) against exact target sampling. Windows of one and two drafts
(MTP-1 verifies one). DSPARK's CPU accept checks only the drafts inside each verify window
(`chain_accept_verified`, its own controls in tests/test_verified_accept.py), so
`bonus_from_draft` acts on every fully accepted window there; with SGLang's own accept
(`cpu_verified_rows_accept` off) the sampler sees all gamma = 7 drafts and trims after sampling,
and `bonus_from_draft` then acts only on fully accepted 7-draft blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_dspark.verification.losslessness import compare_samples, detectable_tv
from sglang_dspark.verification.rejection import chain_speculative_sampling_torch

V, PROMPTS, LENGTH = 48, 3, 4
AUDIT_SAMPLES = 240  # `sglang-dspark audit`'s default


def _model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g) * 3.0
    draft = logits + torch.randn(V, V, generator=g)
    start = torch.randn(PROMPTS, V, generator=g) * 3.0
    return logits.softmax(-1), draft.softmax(-1), start.softmax(-1)


def _target_continuations(p_t, p_0, n, gen) -> list[list[int]]:
    x = torch.multinomial(p_0.expand(n, -1), 1, generator=gen)
    for _ in range(LENGTH - 1):
        x = torch.cat([x, torch.multinomial(p_t[x[:, -1]], 1, generator=gen)], 1)
    return x.tolist()


def _speculative_continuations(p_t, p_d, p_0, n, gamma, gen, broken=None) -> list[list[int]]:
    """Token 0 from the target (prefill); then rounds of gamma drafts verified by the sampler."""
    rows = torch.arange(n)
    out = torch.full((n, LENGTH + gamma + 1), -1, dtype=torch.long)
    out[:, 0] = torch.multinomial(p_0.expand(n, -1), 1, generator=gen)[:, 0]
    length = torch.ones(n, dtype=torch.long)
    slots = gamma + 1
    while (length < LENGTH).any():
        anchor = out[rows, length - 1]
        drafts, draft_probs, cur = [], [], anchor
        for _ in range(gamma):
            q = p_d[cur]
            cur = torch.multinomial(q, 1, generator=gen)[:, 0]
            drafts.append(cur)
            draft_probs.append(q)
        drafts = torch.stack(drafts, 1)
        candidates = torch.cat([anchor[:, None], drafts], 1)
        predicts = torch.full((n * slots,), -1, dtype=torch.int32)
        accept_index = torch.full((n, slots), -1, dtype=torch.int32)
        accepted = torch.zeros(n, dtype=torch.int32)
        retrive = torch.arange(n * slots).view(n, slots)
        chain_speculative_sampling_torch(
            predicts, accept_index, accepted, candidates, retrive, None, None,
            torch.rand(n, gamma, generator=gen), torch.rand(n, generator=gen),
            p_t[candidates], torch.stack(draft_probs, 1), 1.0, 1.0, True, broken=broken,
        )  # fmt: skip
        k = accepted.long()
        tokens = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
        tokens[rows, k] = predicts[retrive[rows, k]].long()  # the replacement or bonus token
        for j in range(slots):
            write = (j <= k) & (length < LENGTH)
            out[rows[write], length[write]] = tokens[write, j]
            length = length + write.long()
    return out[:, :LENGTH].tolist()


def _audit_comparison(broken, *, n=AUDIT_SAMPLES, gamma=1, seed=0):
    p_t, p_d, p_0 = _model()
    gen = torch.Generator().manual_seed(100 + seed)
    test = [
        _speculative_continuations(p_t, p_d, p_0[i], n, gamma, gen, broken) for i in range(PROMPTS)
    ]
    ref = [_target_continuations(p_t, p_0[i], n, gen) for i in range(PROMPTS)]
    return compare_samples(test, ref, [1, 2, 3], joint_positions=(0, 1, 2), alpha=0.01)


@pytest.mark.parametrize("gamma", [1, 2])
def test_lossless_sampler_passes(gamma):
    for seed in range(3):
        report = _audit_comparison(None, gamma=gamma, seed=seed)
        assert report.passed, report.summary()


@pytest.mark.parametrize("mode", ["accept_all", "no_renorm", "bonus_from_draft"])
@pytest.mark.parametrize("gamma", [1, 2])
def test_broken_sampler_is_caught_at_the_audit_sample_size(mode, gamma):
    """Each of three independent audits at 240 samples per prompt flags the broken sampler."""
    for seed in range(3):
        report = _audit_comparison(mode, gamma=gamma, seed=seed)
        assert not report.passed, f"{mode}, gamma {gamma}, seed {seed}: {report.summary()}"


def _position_1_shift(scale: float) -> list[float]:
    """Exact TV between the lossless and the `ratio_scaled:scale` distribution of generated
    token 1 (one draft per round), per prompt."""
    p, q, p_0 = _model()
    kept = q * torch.clamp(scale * p / q, max=1.0)
    residual = (p - q).clamp_min(0)
    out = kept + (1 - kept.sum(-1, keepdim=True)) * residual / residual.sum(-1, keepdim=True)
    return (0.5 * (p_0 @ out - p_0 @ p).abs().sum(-1)).tolist()


def test_ratio_scaled_needs_more_samples_than_the_audit_draws_and_the_power_says_how_many():
    """Acceptance ratio x 1.3 shifts token 1 by TV 0.04-0.12 here, below what 240 samples
    per prompt can promise to see (detectable TV about 0.28 for these tests); the power
    statement names the sample size that suffices for the most shifted prompt, and there the
    same comparison catches it."""
    shift = max(_position_1_shift(1.3))
    assert 0.05 < shift < 0.2
    small = _audit_comparison("ratio_scaled:1.3")
    assert small.detectable_tv(joint=False) > shift  # no promise at 240
    n = AUDIT_SAMPLES
    while detectable_tv(n, n, 20, small.threshold) > shift:  # up to 20 dof per position here
        n *= 2
    assert n <= 8 * AUDIT_SAMPLES
    for seed in range(2):
        report = _audit_comparison("ratio_scaled:1.3", n=n, seed=seed)
        assert not report.passed, f"n = {n}: {report.summary()}"


def test_unknown_broken_mode_is_refused_with_the_valid_modes():
    from sglang_dspark.verification.rejection import parse_broken_mode

    with pytest.raises(ValueError, match="accept_all, no_renorm, bonus_from_draft, ratio_scaled"):
        parse_broken_mode("accept_most")
    assert parse_broken_mode("ratio_scaled:0.7") == ("ratio_scaled", 0.7)
    assert parse_broken_mode(None) == (None, 1.0)


def test_break_sampler_file_switches_a_running_process(tmp_path, monkeypatch):
    """SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE: the mode is read at each call (a missing or empty
    file is the honest sampler, a bad mode is refused), so a test flips one running server."""
    from conftest import controls

    broken_sampler_mode = controls.broken_sampler_mode

    switch = tmp_path / "break"
    monkeypatch.setenv("SGLANG_DSPARK_TEST_BREAK_SAMPLER", "accept_all")
    monkeypatch.setenv("SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE", str(switch))
    assert broken_sampler_mode() is None  # the file, not the variable, decides
    switch.write_text("no_renorm\n")
    assert broken_sampler_mode() == "no_renorm"
    switch.write_text("")
    assert broken_sampler_mode() is None
    switch.write_text("accept_most")
    with pytest.raises(ValueError, match="unknown broken sampler mode"):
        broken_sampler_mode()


def test_the_shipped_sampler_reads_no_test_switch(monkeypatch):
    """The broken-sampler switch is a test-only SGLang plugin: no module of the package reads a
    test variable, and the CPU verification hook stays honest with the switch set."""
    from conftest import controls

    from sglang_dspark.plugin import cpu_sampling
    from sglang_dspark.verification import rejection

    package = Path(rejection.__file__).parent
    readers = [p for p in package.rglob("*.py") if "SGLANG_DSPARK_TEST" in p.read_text()]
    assert readers == []
    monkeypatch.setenv(controls.MODE_ENV, "accept_all")
    honest = getattr(rejection.chain_speculative_sampling_torch, "__wrapped__",
                     rejection.chain_speculative_sampling_torch)  # fmt: skip
    monkeypatch.setattr(rejection, "chain_speculative_sampling_torch", honest)  # no controls
    p_t = torch.tensor([[0.9, 0.1, 0.0, 0.0]] * 2)
    p_d = torch.tensor([[0.0, 0.0, 0.0, 1.0]])  # a draft the target never takes
    args = _verify_args(p_t, p_d)
    cpu_sampling._dispatch(None, *args)
    assert int(args[2][0]) == 0  # honest: the impossible draft is rejected
    controls.install()
    args = _verify_args(p_t, p_d)
    cpu_sampling._dispatch(None, *args)
    assert int(args[2][0]) == 1  # with the test plugin installed, accept_all keeps it


def _verify_args(p_t: torch.Tensor, p_d: torch.Tensor) -> tuple:
    """chain_speculative_sampling_triton's arguments for one request with one draft (token 3)."""
    predicts = torch.zeros(2, dtype=torch.int32)
    accept_index = torch.full((1, 2), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    candidates = torch.tensor([[0, 3]])
    return (predicts, accept_index, accept_num, candidates, torch.arange(2).view(1, 2), None,
            None, torch.full((1, 2), 0.5), torch.full((1,), 0.5), p_t[None], p_d[None], 1.0,
            1.0, True)  # fmt: skip


@pytest.mark.slow
def test_the_controls_plugin_loads_only_from_its_folder():
    """SGLang's plugin loader installs the controls in a process whose PYTHONPATH holds
    tests/controls (what the test servers get), and not otherwise."""
    from conftest import controls

    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "import sglang_dspark.verification.rejection as r; "
            "print('CONTROLS', getattr(r.chain_speculative_sampling_torch, '_test_controls', False))")  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base["SGLANG_USE_CPU_ENGINE"] = "1"
    for env, want in ((controls.server_env(base), "True"), (base, "False")):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=False)  # fmt: skip
        assert f"CONTROLS {want}" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]

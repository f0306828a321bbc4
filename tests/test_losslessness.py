"""Temperature 1: DSPARK's output distribution equals the target's, on the real server.

For a few prompts we draw many short continuations from the embedded server with and without
DSPARK and compare, per prompt and per generated position 2..4 (position 1 comes from prefill,
not from speculation), the token distributions with chi-square tests at a family-wise
false-alarm rate of 1% (sglang_dspark.losslessness). The same test must fail on a server whose
sampler keeps every draft token (SGLANG_DSPARK_TEST_BREAK_SAMPLER=accept_all).
"""

from __future__ import annotations

import pytest
import requests

from sglang_dspark.client import chat_prompt_ids
from sglang_dspark.losslessness import compare_samples

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]
SAMPLES = 240
NEW_TOKENS = 4
POSITIONS = [1, 2, 3]  # 0-based: generated tokens 2..4


def _sample(server, prompt_ids: list[int]) -> tuple[list[list[int]], dict]:
    body = {
        "input_ids": [prompt_ids] * SAMPLES,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True},
    }
    out = requests.post(server.base_url + "/generate", json=body, timeout=1800)
    out.raise_for_status()
    rows = out.json()
    stats = {
        "correct": sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in rows),
        "proposed": sum(r["meta_info"].get("spec_num_proposed_drafts", 0) for r in rows),
    }
    return [r["output_ids"] for r in rows], stats


def _collect(server, prompts):
    samples, correct, proposed = [], 0, 0
    for ids in prompts:
        s, st = _sample(server, ids)
        samples.append(s)
        correct += st["correct"]
        proposed += st["proposed"]
    return samples, correct, proposed


@pytest.fixture(scope="module")
def prompt_ids(embedded_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_paths.target)
    return [chat_prompt_ids(tok, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(servers, embedded_paths, prompt_ids):
    samples, _, _ = _collect(servers.get(embedded_paths, speculative=False), prompt_ids)
    return samples


def test_dspark_temperature_1_matches_target_distribution(
    servers, embedded_paths, prompt_ids, reference
):
    samples, correct, proposed = _collect(servers.get(embedded_paths), prompt_ids)
    # drafts must be both accepted and rejected, or the test exercises nothing
    assert 0 < correct < proposed, f"{correct} of {proposed} drafts accepted"
    report = compare_samples(samples, reference, POSITIONS, alpha=0.01)
    assert len(report.tests) >= 6
    assert report.passed, report.summary()


def test_broken_sampler_fails_the_same_test(servers, embedded_paths, prompt_ids, reference):
    # static mode verifies every proposed draft, so "every draft kept" is visible in the counts
    # (under sync scheduling only the drafts in each trimmed window can be kept; the audit test
    # below breaks the sampler of the scheduling server)
    broken = servers.get(
        embedded_paths,
        env={"SGLANG_DSPARK_TEST_BREAK_SAMPLER": "accept_all", "SGLANG_DSPARK_SCHEDULER": "static"},
    )
    samples, correct, proposed = _collect(broken, prompt_ids)
    assert correct == proposed  # every draft kept
    report = compare_samples(samples, reference, POSITIONS, alpha=0.01)
    assert not report.passed, report.summary()


def test_mtp1_baseline_temperature_1_matches_target_and_broken_sampler_does_not(
    servers, embedded_paths, prompt_ids, reference
):
    """The MTP-1 baseline on CPU verifies temperature-1 requests by target-only rejection
    sampling (upstream forces the target's argmax on CPU): the same per-position tests pass,
    and fail when the sampler keeps every draft."""
    samples, correct, proposed = _collect(servers.get(embedded_paths, arm="mtp1"), prompt_ids)
    assert 0 < correct < proposed, f"{correct} of {proposed} drafts accepted"
    report = compare_samples(samples, reference, POSITIONS, alpha=0.01)
    assert len(report.tests) >= 6
    assert report.passed, report.summary()
    broken = servers.get(
        embedded_paths, arm="mtp1", env={"SGLANG_DSPARK_TEST_BREAK_SAMPLER": "accept_all"}
    )
    samples, correct, proposed = _collect(broken, prompt_ids)
    assert correct == proposed  # every draft kept
    report = compare_samples(samples, reference, POSITIONS, alpha=0.01)
    assert not report.passed, report.summary()


def test_audit_command_passes_on_dspark_and_fails_on_broken_sampler(servers, embedded_paths):
    """`sglang-dspark audit` against the embedded default (sync scheduling on): exit 0; then
    exit 1 for the same scheduling server with the sampler broken."""
    import subprocess
    import sys

    reference = servers.get(embedded_paths, speculative=False)
    good = servers.get(embedded_paths)
    cmd = [sys.executable, "-m", "sglang_dspark.cli", "audit", "--reference-url",
           reference.base_url, "--samples", "160"]  # fmt: skip
    ok = subprocess.run(cmd + ["--url", good.base_url], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "LOSSLESS" in ok.stdout
    broken = servers.get(embedded_paths, env={"SGLANG_DSPARK_TEST_BREAK_SAMPLER": "accept_all"})
    bad = subprocess.run(cmd + ["--url", broken.base_url], capture_output=True, text=True, check=False)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "NOT LOSSLESS" in bad.stdout

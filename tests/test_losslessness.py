"""Temperature 1: DSPARK's output distribution equals the target's, on the real server.

For a few prompts we draw many short continuations from the embedded server with and without
DSPARK and compare, per prompt, the token distributions at generated positions 2..4 (position 1
comes from prefill, not from speculation) and the joint distribution of the first three tokens,
with chi-square tests at a family-wise false-alarm rate of 0.1% (sglang_dspark.losslessness). The
same tests must fail when the server's sampler keeps every draft token (`accept_all`);
`sglang-dspark audit` must fail when its replacement token comes from the unrenormalised residual
(`no_renorm`) and on a server that does not speculate at all. The broken samplers are the same
running servers switched through SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE (`servers.broken`), so
the file needs three servers: plain, DSPARK and MTP-1. Which broken samplers these sample sizes catch, and which they cannot, is
worked out without a server in tests/test_negative_controls.py.
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
# 320 continuations per prompt at a family-wise 0.1%: every passing run detects a shift of
# TV >= 0.23 at one position with power 0.8. 240 at 1% had the same power but a 1% false alarm
# per test run, which one CI run hit (p = 0.00075 < 0.00083); 960 samples of the same servers then
# found no difference (smallest p = 0.12).
SAMPLES = 320
# A broken sampler moves the marginals far more (accept_all: about 1 - acceptance, TV ~ 0.5):
# 120 samples against the reference's 320 detect TV >= 0.35 with power 0.8 at each test.
BROKEN_SAMPLES = 120
ALPHA = 0.001
NEW_TOKENS = 4
POSITIONS = [1, 2, 3]  # 0-based: generated tokens 2..4
JOINT = (0, 1, 2)  # the first three generated tokens as one category


def _sample(server, prompt_ids: list[int], n: int = SAMPLES) -> tuple[list[list[int]], dict]:
    body = {
        "input_ids": [prompt_ids] * n,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True},
    }
    out = requests.post(server.base_url + "/generate", json=body, timeout=1800)
    out.raise_for_status()
    rows = out.json()
    meta = [r["meta_info"] for r in rows]
    stats = {
        "correct": sum(m.get("spec_num_correct_drafts", 0) for m in meta),
        "proposed": sum(m.get("spec_num_proposed_drafts", 0) for m in meta),
        # drafts in the verified windows: SGLang's cap length counts a window's tokens, the
        # drafts and the one position after them (`verify_lens`)
        "verified": sum(
            round(m.get("spec_cap_length", 0) * m.get("spec_verify_ct", 0))
            - m.get("spec_verify_ct", 0)
            for m in meta
        ),
    }
    return [r["output_ids"] for r in rows], stats


def _collect(server, prompts, n: int = SAMPLES):
    """(samples per prompt, drafts accepted, proposed, in verified windows), summed."""
    samples, correct, proposed, verified = [], 0, 0, 0
    for ids in prompts:
        s, st = _sample(server, ids, n)
        samples.append(s)
        correct += st["correct"]
        proposed += st["proposed"]
        verified += st["verified"]
    return samples, correct, proposed, verified


@pytest.fixture(scope="module")
def prompt_ids(embedded_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_paths.target)
    return [chat_prompt_ids(tok, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(servers, embedded_paths, prompt_ids):
    samples, *_ = _collect(servers.get(embedded_paths, speculative=False), prompt_ids)
    return samples


def test_dspark_temperature_1_matches_target_distribution(
    servers, embedded_paths, prompt_ids, reference
):
    samples, correct, proposed, _ = _collect(servers.get(embedded_paths), prompt_ids)
    # drafts must be both accepted and rejected, or the test exercises nothing
    assert 0 < correct < proposed, f"{correct} of {proposed} drafts accepted"
    report = compare_samples(samples, reference, POSITIONS, joint_positions=JOINT, alpha=ALPHA)
    assert len(report.tests) >= 6
    assert any(t.joint for t in report.tests), report.summary()
    assert report.passed, report.summary()


def test_broken_sampler_fails_the_same_test(servers, embedded_paths, prompt_ids, reference):
    """The same server with its sampler switched to keep every draft: every draft of every
    scheduled window is kept (sync scheduling verifies a trimmed window, so the proposed count,
    gamma per round, is larger), and the same tests fail."""
    with servers.broken(servers.get(embedded_paths), "accept_all") as broken:
        samples, correct, proposed, verified = _collect(broken, prompt_ids, n=BROKEN_SAMPLES)
    assert 0 < correct == verified <= proposed, (correct, verified, proposed)
    report = compare_samples(samples, reference, POSITIONS, joint_positions=JOINT, alpha=ALPHA)
    assert not report.passed, report.summary()


def test_mtp1_baseline_temperature_1_matches_target_and_broken_sampler_does_not(
    servers, embedded_paths, prompt_ids, reference
):
    """The MTP-1 baseline on CPU verifies temperature-1 requests by target-only rejection
    sampling (upstream forces the target's argmax on CPU): the same per-position tests pass,
    and fail when the sampler keeps every draft."""
    samples, correct, proposed, _ = _collect(servers.get(embedded_paths, arm="mtp1"), prompt_ids)
    assert 0 < correct < proposed, f"{correct} of {proposed} drafts accepted"
    report = compare_samples(samples, reference, POSITIONS, joint_positions=JOINT, alpha=ALPHA)
    assert len(report.tests) >= 6
    assert any(t.joint for t in report.tests), report.summary()
    assert report.passed, report.summary()
    with servers.broken(servers.get(embedded_paths, arm="mtp1"), "accept_all") as broken:
        samples, correct, proposed, _ = _collect(broken, prompt_ids, n=BROKEN_SAMPLES)
    assert correct == proposed  # every draft kept
    report = compare_samples(samples, reference, POSITIONS, joint_positions=JOINT, alpha=ALPHA)
    assert not report.passed, report.summary()


def _audit(url: str, reference_url: str, *extra: str):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "sglang_dspark.cli", "audit", "--url", url, "--reference-url",
           reference_url, *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_audit_command_fails_on_a_server_that_does_not_speculate(servers, embedded_paths):
    """A plain server's output equals the reference's: the audit must not call that lossless
    speculation (it stops after the greedy part, before any sampling)."""
    plain = servers.get(embedded_paths, speculative=False)
    out = _audit(plain.base_url, plain.base_url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no draft was proposed" in out.stdout and "NOT LOSSLESS" in out.stdout
    assert "greedy prompt 0: equal" in out.stdout  # it did compare, and found nothing wrong
    assert "skipped (no speculation to test)" in out.stdout


def test_audit_command_passes_on_dspark_and_fails_on_broken_sampler(servers, embedded_paths):
    """`sglang-dspark audit` against the embedded default (sync scheduling on): exit 0, with
    drafts proposed and accepted and the power printed (160 samples at a family-wise 0.1%: the
    pass checks the command end to end, its false alarms are what matter); then exit 1, with the
    audit's defaults as a user runs it, for the same scheduling server whose replacement token is
    drawn from max(0, p_t - p_d) without renormalising."""
    reference = servers.get(embedded_paths, speculative=False)
    good = servers.get(embedded_paths)
    ok = _audit(good.base_url, reference.base_url, "--samples", "160", "--alpha", str(ALPHA))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "LOSSLESS" in ok.stdout and "NOT LOSSLESS" not in ok.stdout
    assert "detects with power 0.8: per position TV >= " in ok.stdout
    assert "avg_spec_accept_length" in ok.stdout
    with servers.broken(good, "no_renorm"):
        bad = _audit(good.base_url, reference.base_url)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "NOT LOSSLESS" in bad.stdout and "temperature 1: FAIL" in bad.stdout

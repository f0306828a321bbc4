"""Temperature 1: DSPARK's output distribution equals the target's, on the real server.

For the audit's three prompts we draw many short continuations from the embedded server with
and without DSPARK and compare, per prompt, the token distributions at generated positions 2..4
(position 1 comes from prefill, not from speculation) and the joint distribution of the first
three tokens, with chi-square tests at a family-wise false-alarm rate of 0.1%
(sglang_dspark.verification.losslessness). The DSPARK comparison is `sglang-dspark audit` itself, as a user
runs it; it keeps the plain server's continuations (`--reference-samples`), against which the
other tests compare. The same tests must fail when the server's sampler keeps every draft token
(`accept_all`), for DSPARK and for the MTP-1 baseline; the audit must fail when the replacement
token comes from the unrenormalised residual (`no_renorm`) and on a server that does not
speculate at all. The broken samplers are the same running servers switched through
SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE (`servers.broken`), so the file needs three servers:
plain, DSPARK and MTP-1. Which broken samplers these sample sizes catch, and which they cannot,
is worked out without a server in tests/test_negative_controls.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import sample_prompts, verify_every_draft

from sglang_dspark.serving.client import chat_prompt_ids
from sglang_dspark.verification.audit import (
    DEFAULT_PROMPTS,
    ReferenceSamples,
    reference_samples_key,
)
from sglang_dspark.verification.losslessness import compare_samples

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

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
# the audit's own temperature-1 requests (`sglang_dspark.verification.audit.audit`)
SAMPLING = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}


def _collect(server, prompts, n: int = SAMPLES):
    """(samples per prompt, drafts accepted, proposed, in verified windows), summed."""
    got = sample_prompts(server, prompts, n, SAMPLING)
    return got.samples, got.correct, got.proposed, got.verified


def _audit(url: str, reference_url: str, *extra: str):
    cmd = [sys.executable, "-m", "sglang_dspark.cli", "audit", "--url", url, "--reference-url",
           reference_url, *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def prompt_ids(embedded_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_paths.target)
    return [chat_prompt_ids(tok, p) for p in DEFAULT_PROMPTS]


@pytest.fixture(scope="module")
def reference_store(tmp_path_factory):
    """The plain server's continuations, kept by the audit (`--reference-samples`)."""
    return tmp_path_factory.mktemp("audit") / "reference-samples.json"


def test_dspark_temperature_1_matches_target_distribution(
    servers, embedded_paths, reference_store, tmp_path
):
    """`sglang-dspark audit` against the embedded default (sync scheduling on) at SAMPLES and
    ALPHA: exit 0, drafts both accepted and rejected (or the test exercises nothing), every
    per-position and joint test run, the power and the server's accept length printed."""
    plain = servers.get(embedded_paths, speculative=False)
    dspark = servers.get(embedded_paths)
    report = tmp_path / "audit.json"
    out = _audit(dspark.base_url, plain.base_url, "--samples", str(SAMPLES), "--alpha", str(ALPHA),
                 "--json", str(report), "--reference-samples", str(reference_store))  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "LOSSLESS" in out.stdout and "NOT LOSSLESS" not in out.stdout
    assert "detects with power 0.8: per position TV >= " in out.stdout
    assert "avg_spec_accept_length" in out.stdout
    record = json.loads(report.read_text())
    correct, proposed = record["drafts_accepted"], record["drafts_proposed"]
    assert 0 < correct < proposed, f"{correct} of {proposed} drafts accepted"
    assert record["sampling_tests"] >= 6 and record["sampling_joint_tests"] >= 1, out.stdout
    kept = json.loads(reference_store.read_text())["samples"]
    assert [len(s) for s in kept] == [SAMPLES] * len(DEFAULT_PROMPTS)


@pytest.fixture(scope="module")
def reference(servers, embedded_paths, prompt_ids, reference_store):
    """The plain server's SAMPLES continuations per prompt: those the audit above kept (drawn
    here when that test did not run)."""
    plain = servers.get(embedded_paths, speculative=False)
    store = ReferenceSamples.open(
        reference_store, reference_samples_key(plain.base_url, prompt_ids, SAMPLING)
    )

    def draw(i):
        return lambda n: sample_prompts(plain, [prompt_ids[i]], n, SAMPLING).samples[0]

    return [store.take(i, SAMPLES, draw(i)) for i in range(len(prompt_ids))]


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
    """The MTP-1 baseline on CPU samples its draft from q and verifies it against q by chain
    rejection sampling (--speculative-use-rejection-sampling; upstream forces the target's argmax
    on CPU): the same per-position tests pass, and fail when the sampler keeps every draft."""
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


def test_audit_command_fails_on_a_server_that_does_not_speculate(servers, embedded_paths):
    """A plain server's output equals the reference's: the audit must not call that lossless
    speculation (it stops after the greedy part, before any sampling)."""
    plain = servers.get(embedded_paths, speculative=False)
    out = _audit(plain.base_url, plain.base_url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no draft was proposed" in out.stdout and "NOT LOSSLESS" in out.stdout
    assert "greedy prompt 0: equal" in out.stdout  # it did compare, and found nothing wrong
    assert "skipped (no speculation to test)" in out.stdout


def test_audit_command_fails_on_a_sampler_that_does_not_renormalise(
    servers, embedded_paths, reference_store
):
    """The audit's defaults, as a user runs them, against the same scheduling server whose
    replacement token is drawn from max(0, p_t - p_d) without renormalising: exit 1. The
    reference's continuations are the ones kept by the first audit (its first 240 of 320).

    The defect shows only where a verified window rejects a draft, so the server verifies every
    draft here (`verify_every_draft`): how often it rejects must not hang on how this machine's
    start-up SPS profile trims the 240-request batches (with trimmed windows one CI run saw too
    few rejections for the defaults' power: smallest p = 0.0012 against 0.00083). The server is
    retired afterwards, since the forced budget cannot be handed back."""
    reference = servers.get(embedded_paths, speculative=False)
    good = servers.get(embedded_paths)
    try:
        verify_every_draft(good)
        with servers.broken(good, "no_renorm"):
            bad = _audit(good.base_url, reference.base_url,
                         "--reference-samples", str(reference_store))  # fmt: skip
    finally:
        servers.retire(good)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "NOT LOSSLESS" in bad.stdout and "temperature 1: FAIL" in bad.stdout

"""The torch rejection sampler: exact against SGLang's Triton kernel, and lossless."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from sglang_dspark.verification.rejection import chain_rejection_sample


def test_output_distribution_equals_target_and_accept_all_does_not():
    """One draft position, vocabulary of 4: the first output token must follow p_t."""
    g = torch.Generator().manual_seed(0)
    p_t = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p_d = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 200_000
    drafts = torch.multinomial(p_d, n, replacement=True, generator=g)[:, None]
    target = p_t.expand(n, 2, 4)
    draft = p_d.expand(n, 1, 4)
    acc, nxt = chain_rejection_sample(drafts, target, draft, generator=g)
    first = torch.where(acc > 0, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=4).float() / n
    # 5 standard errors at n = 200k is < 0.006 for every category
    assert torch.allclose(freq, p_t, atol=0.006), freq
    # accepting every draft returns p_d instead, far outside the same tolerance
    assert not torch.allclose(drafts[:, 0].bincount(minlength=4).float() / n, p_t, atol=0.006)
    # expected acceptance is 1 - TV(p_d, p_t)
    assert abs(acc.float().mean() - (1 - 0.5 * (p_t - p_d).abs().sum())) < 0.005


SCRIPT = textwrap.dedent(
    """
    import torch
    from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton
    from sglang_dspark.verification.rejection import chain_speculative_sampling_torch

    torch.manual_seed(1)
    bs, n, vocab = 6, 5, 40
    def run(fn, coins, final, cand, tp, dp):
        out = dict(
            predicts=torch.full((bs * n,), -1, dtype=torch.int32),
            accept_index=torch.full((bs, n), -1, dtype=torch.int32),
            accept_token_num=torch.zeros(bs, dtype=torch.int32),
        )
        fn(**out, candidates=cand, retrive_index=torch.arange(bs * n).view(bs, n),
           retrive_next_token=None, retrive_next_sibling=None, uniform_samples=coins,
           uniform_samples_for_final_sampling=final, target_probs=tp, draft_probs=dp,
           threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        return out
    for trial in range(20):
        tp = torch.softmax(torch.randn(bs, n, vocab) * 3, -1)
        dp = torch.softmax(torch.randn(bs, n - 1, vocab) * 3, -1)
        # drafts sampled from the draft, sometimes equal to the target's argmax
        cand = torch.randint(0, vocab, (bs, n))
        cand[:, 1:] = torch.multinomial(dp.view(-1, vocab), 1).view(bs, n - 1)
        if trial % 2:
            cand[:, 1:] = tp[:, :-1].argmax(-1)
        coins, final = torch.rand(bs, n - 1), torch.rand(bs)
        a = run(chain_speculative_sampling_triton, coins, final, cand, tp, dp)
        b = run(chain_speculative_sampling_torch, coins, final, cand, tp, dp)
        for k in a:
            assert torch.equal(a[k], b[k]), (trial, k, a[k], b[k])
    print("IDENTICAL")
    """
)


def test_torch_sampler_is_identical_to_sglang_triton_kernel():
    """Same coins in, same buffers out: the Triton kernel run by Triton's CPU interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert "IDENTICAL" in proc.stdout, proc.stderr[-3000:]

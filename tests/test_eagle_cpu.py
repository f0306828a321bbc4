"""The torch versions of SGLang's EAGLE kernels that the plugin installs on CPU (MTP-1 baseline).

Tree construction, greedy tree verification and top-k / top-p renormalisation are checked
against SGLang's own Triton kernels run by Triton's CPU interpreter (same inputs, same
buffers out); target-only verification is checked for losslessness by counting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import controls

from sglang_dspark.plugin.cpu_eagle import (
    chain_speculative_sampling_cpu,
    tree_speculative_sampling_target_only_torch,
)

SCRIPT = textwrap.dedent(
    """
    import random
    import torch
    from sglang.kernels.ops.sampling import renorm_triton
    from sglang.kernels.ops.speculative import spec_tree
    from sglang_dspark.plugin import cpu_eagle

    rng = random.Random(0)
    torch.manual_seed(0)
    checked = 0
    for trial in range(40):
        topk = rng.choice([1, 2, 4])
        steps = rng.randint(1, 4)
        n = rng.randint(2, min(8, topk * steps + 1)) if topk > 1 else steps + 1
        bs = rng.randint(1, 4)
        count = topk + (steps - 1) * topk * topk
        width = 1 + (steps - 1) * topk
        parents = torch.randint(0, count, (bs, width))
        parents[:, 0] = -1
        selected = torch.stack([
            torch.tensor(sorted(rng.sample(range(count), n - 1))) for _ in range(bs)
        ])
        seq_lens = torch.randint(1, 9, (bs,))
        for mode in (spec_tree.TreeMaskMode.FULL_MASK, spec_tree.TreeMaskMode.QLEN_ONLY):
            size = int(seq_lens.sum()) * n + n * n * bs if mode == 0 else n * n * bs
            outs = []
            for fn in (spec_tree.sgl_build_tree_kernel_triton,
                       cpu_eagle.build_tree_kernel_efficient_cpu):
                buf = dict(
                    tree_mask=torch.full((size,), True),
                    positions=torch.empty(bs * n, dtype=torch.long),
                    retrieve_index=torch.full((bs, n), -1, dtype=torch.long),
                    retrieve_next_token=torch.full((bs, n), -1, dtype=torch.long),
                    retrieve_next_sibling=torch.full((bs, n), -1, dtype=torch.long),
                )
                fn(parents, selected, seq_lens, buf["tree_mask"], buf["positions"],
                   buf["retrieve_index"], buf["retrieve_next_token"],
                   buf["retrieve_next_sibling"], topk, steps, n, mode)
                outs.append(buf)
            for k in outs[0]:
                assert torch.equal(outs[0][k], outs[1][k]), (trial, mode, k, outs[0][k], outs[1][k])
        # greedy verification over that tree, with tokens that often match
        tree = outs[1]
        vocab = 3
        candidates = torch.randint(0, vocab, (bs, n))
        target = torch.randint(0, vocab, (bs, n))
        depth = steps + 1
        res = []
        for fn in (spec_tree.verify_tree_greedy_triton, cpu_eagle.verify_tree_greedy_cpu):
            buf = dict(predicts=torch.zeros(bs * n, dtype=torch.int32),
                       accept_index=torch.full((bs, depth), -1, dtype=torch.int32),
                       accept_token_num=torch.zeros(bs, dtype=torch.int32))
            args = (candidates, tree["retrieve_index"], tree["retrieve_next_token"],
                    tree["retrieve_next_sibling"], target)
            fn(buf["predicts"], buf["accept_index"], buf["accept_token_num"], *args)
            res.append(buf)
        for k in res[0]:
            assert torch.equal(res[0][k], res[1][k]), (trial, k, res[0][k], res[1][k])
        checked += 1
    renorm_triton._prepare_probs = lambda p: p.float().contiguous()  # the CUDA check only
    probs = torch.softmax(torch.randn(6, 5000) * 3, -1)
    top_ks = torch.tensor([1, 2, 7, 50, 5000, 300])
    top_ps = torch.tensor([0.01, 0.3, 0.5, 0.9, 0.99, 1.0])
    for ours, theirs, arg in [
        (cpu_eagle.top_k_renorm_prob_torch, renorm_triton.top_k_renorm_probs_triton, top_ks),
        (cpu_eagle.top_p_renorm_prob_torch, renorm_triton.top_p_renorm_probs_triton, top_ps),
    ]:
        a, b = ours(probs, arg), theirs(probs, arg)
        assert torch.equal(a > 0, b > 0), ours.__name__
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    print("IDENTICAL", checked)
    """
)


@pytest.mark.slow
def test_tree_and_renorm_ops_are_identical_to_sglang_triton_kernels():
    """Random trees (topk 1, 2, 4; 1-4 steps; both CPU mask modes) and random rows."""
    env = dict(os.environ, TRITON_INTERPRET="1", SGLANG_USE_CPU_ENGINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    assert "IDENTICAL 40" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def _first_tokens(p_t, q, n, *, broken=False, seed=0, verify_against_q=False):
    """One draft from q per request, verified target-only (or, with `verify_against_q`, by
    rejection sampling against q: `--speculative-use-rejection-sampling`); returns each
    request's first token and whether its draft was kept."""
    g = torch.Generator().manual_seed(seed)
    vocab = p_t.numel()
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    target = torch.stack([p_t, p_t]).expand(n, 2, vocab).contiguous()
    predicts = torch.zeros(2 * n, dtype=torch.int32)
    accept_index = torch.full((n, 2), -1, dtype=torch.int32)
    accepted = torch.empty(n, dtype=torch.int32)
    controls.install()  # the test-only switch (honest unless the variable asks otherwise)
    env = {controls.MODE_ENV: "accept_all"} if broken else {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        verify = (
            chain_speculative_sampling_cpu
            if verify_against_q
            else tree_speculative_sampling_target_only_torch
        )
        verify(
            predicts, accept_index, accepted, torch.stack([torch.zeros_like(drafts), drafts], 1),
            torch.arange(2 * n).view(n, 2), None, None, torch.rand(n, 2, generator=g),
            torch.rand(n, generator=g), target, q.expand(n, 1, vocab).contiguous(), 1.0, 1.0,
            True,
        )  # fmt: skip
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    # slot 0's successor is the first generated token: the draft if kept, else its replacement
    return predicts.view(n, 2)[:, 0].long(), accepted


def test_target_only_verification_is_lossless_and_broken_sampler_is_not():
    p_t = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])  # a poor proposal: losslessness must not depend on it
    n = 200_000
    first, accepted = _first_tokens(p_t, q, n)
    freq = torch.bincount(first, minlength=4).float() / n
    assert torch.allclose(freq, p_t, atol=0.006), freq  # 5 standard errors at n = 200k
    # a draft x is kept with probability p_t(x): mean acceptance sum_x q(x) p_t(x)
    assert abs(accepted.float().mean() - (q * p_t).sum()) < 0.005
    broken, kept = _first_tokens(p_t, q, n, broken=True)
    assert kept.all()
    assert not torch.allclose(torch.bincount(broken, minlength=4).float() / n, p_t, atol=0.006)


def test_rejection_sampling_verification_is_lossless_and_accepts_one_minus_tv():
    """`--speculative-use-rejection-sampling` (the embedded MTP-1 arm): a draft sampled from q
    and verified against q is kept with probability min(1, p/q), so the mean acceptance is
    sum_x min(p, q) = 1 - TV, above target-only's sum_x q(x) p(x) for the same draft."""
    p_t = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.4, 0.2, 0.3, 0.1])
    n = 200_000
    first, accepted = _first_tokens(p_t, q, n, verify_against_q=True)
    freq = torch.bincount(first, minlength=4).float() / n
    assert torch.allclose(freq, p_t, atol=0.006), freq
    assert abs(accepted.float().mean() - torch.minimum(p_t, q).sum()) < 0.005
    _, target_only = _first_tokens(p_t, q, n)
    assert accepted.float().mean() > target_only.float().mean() + 0.3
    broken, kept = _first_tokens(p_t, q, n, broken=True, verify_against_q=True)
    assert kept.all()
    assert not torch.allclose(torch.bincount(broken, minlength=4).float() / n, p_t, atol=0.006)


def test_the_hook_routes_upstream_chain_kernel_to_the_cpu_sampler():
    """On CPU, eagle_utils' Triton chain kernel (what upstream's verify calls under
    --speculative-use-rejection-sampling) is replaced by our chain sampler."""
    script = textwrap.dedent(
        """
        from sglang.srt.speculative import eagle_utils
        from sglang_dspark.plugin import cpu_eagle
        cpu_eagle.install_sampling_verify()
        ok = eagle_utils.chain_speculative_sampling_triton is cpu_eagle.chain_speculative_sampling_cpu
        print("ROUTED" if ok else "NOT ROUTED")
        """
    )
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert "ROUTED" in proc.stdout.splitlines(), proc.stdout[-2000:] + proc.stderr[-3000:]

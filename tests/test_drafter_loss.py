"""The DSpark loss against hand-computed values."""

from __future__ import annotations

import math

import torch

from sglang_dspark.drafter.training.loss import LossWeights, combine, loss_sums, position_weights

LN = math.log


def _example():
    # One block, gamma = 2, vocabulary {0, 1}.
    draft = torch.tensor([[[0.0, 0.0], [LN(3), 0.0]]])  # p_d = (.5, .5), (.75, .25)
    target = torch.tensor([[[LN(4), 0.0], [0.0, 0.0]]])  # p_t = (.8, .2), (.5, .5)
    labels = torch.tensor([[0, 1]])
    conf = torch.tensor([[0.0, LN(3)]])  # c = .5, .75
    return draft, target, labels, conf


def test_position_weights():
    w = position_weights(7, 4.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(7.0) / 4.0))
    assert w[0] == 1.0
    torch.testing.assert_close(position_weights(3, 0.0), torch.ones(3))


def test_terms_by_hand():
    draft, target, labels, conf = _example()
    s = loss_sums(draft, target, labels, torch.ones(1, 2, dtype=torch.bool), conf, decay=1.0)
    w2 = math.exp(-1.0)
    ce = LN(2) + w2 * LN(4)  # -log .5, -log .25
    tv = 0.6 + w2 * 0.5  # |.5-.8|+|.5-.2|, |.75-.5|+|.25-.5|
    # c* = 1 - TV/2 = .7, .75; BCE(.5; .7) = ln 2; BCE(.75; .75) = entropy(.75)
    bce2 = -(0.75 * LN(0.75) + 0.25 * LN(0.25))
    conf_sum = LN(2) + w2 * bce2
    torch.testing.assert_close(s.ce, torch.tensor(ce))
    torch.testing.assert_close(s.tv, torch.tensor(tv))
    torch.testing.assert_close(s.conf, torch.tensor(conf_sum))
    torch.testing.assert_close(s.weight, torch.tensor(1 + w2))
    torch.testing.assert_close(s.accept, torch.tensor(0.7 + 0.75))  # unweighted 1 - TV/2
    assert s.count == 2
    loss = combine(s, LossWeights(decay=1.0), s.weight)
    expected = (0.1 * ce + 0.9 * tv + 1.0 * conf_sum) / (1 + w2)
    torch.testing.assert_close(loss, torch.tensor(expected))


def test_invalid_positions_get_no_weight():
    draft, target, labels, conf = _example()
    s = loss_sums(draft, target, labels, torch.tensor([[True, False]]), conf, decay=1.0)
    torch.testing.assert_close(s.ce, torch.tensor(LN(2)))
    torch.testing.assert_close(s.tv, torch.tensor(0.6))
    torch.testing.assert_close(s.weight, torch.tensor(1.0))
    assert s.count == 1


def test_global_normaliser_makes_split_invariant():
    """Two halves normalised by the global weight total sum to the whole-batch loss."""
    gen = torch.Generator().manual_seed(0)
    draft = torch.randn(6, 4, 11, generator=gen)
    target = torch.randn(6, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (6, 4), generator=gen)
    valid = torch.rand(6, 4, generator=gen) > 0.3
    conf = torch.randn(6, 4, generator=gen)
    lw = LossWeights()
    whole = loss_sums(draft, target, labels, valid, conf, decay=4.0)
    a = loss_sums(draft[:2], target[:2], labels[:2], valid[:2], conf[:2], decay=4.0)
    b = loss_sums(draft[2:], target[2:], labels[2:], valid[2:], conf[2:], decay=4.0)
    total = a.weight + b.weight
    torch.testing.assert_close(
        combine(a, lw, total) + combine(b, lw, total), combine(whole, lw, whole.weight)
    )


def test_confidence_label_is_detached():
    """CONF trains the confidence head only: c*_k does not pull the draft distribution."""
    draft, target, labels, conf = _example()
    draft.requires_grad_(True)
    conf.requires_grad_(True)
    s = loss_sums(draft, target, labels, torch.ones(1, 2, dtype=torch.bool), conf, decay=4.0)
    combine(s, LossWeights(ce=0.0, tv=0.0, conf=1.0), s.weight).backward()
    assert draft.grad is None or float(draft.grad.abs().max()) == 0.0
    assert float(conf.grad.abs().max()) > 0.0


def _reference_tv_ce(draft, target, labels):
    log_pd = torch.log_softmax(draft.float(), dim=-1)
    p_t = torch.softmax(target.float(), dim=-1)
    tv = (log_pd.exp() - p_t).abs().sum(dim=-1)
    ce = -log_pd.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return tv, ce


def test_fused_tv_ce_matches_autograd_over_several_chunks(monkeypatch):
    """The chunked TV/CE with its closed-form backward equals plain autograd, values and
    gradients, when rows span several chunks and the two terms get different weights."""
    from sglang_dspark.drafter.training import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_CHUNK_ROWS", 3)
    gen = torch.Generator().manual_seed(0)
    draft = torch.randn(4, 2, 11, generator=gen, dtype=torch.float64) * 2
    target = torch.randn(4, 2, 11, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, 11, (4, 2), generator=gen)
    w_tv = torch.rand(4, 2, generator=gen, dtype=torch.float64)
    w_ce = torch.rand(4, 2, generator=gen, dtype=torch.float64)

    a = draft.clone().requires_grad_(True)
    tv, ce = loss_mod.tv_ce(a, target, labels)
    ((tv * w_tv).sum() + (ce * w_ce).sum()).backward()

    b = draft.clone().requires_grad_(True)
    tv_ref, ce_ref = _reference_tv_ce(b, target, labels)
    ((tv_ref * w_tv).sum() + (ce_ref * w_ce).sum()).backward()

    torch.testing.assert_close(tv.double(), tv_ref.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce.double(), ce_ref.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    assert a.grad.abs().sum() > 0


def test_fused_tv_ce_single_term_gradient():
    """Only TV used (CE unused): the CE part contributes nothing to the gradient."""
    from sglang_dspark.drafter.training.loss import tv_ce

    gen = torch.Generator().manual_seed(1)
    draft = torch.randn(5, 7, generator=gen)
    target = torch.randn(5, 7, generator=gen)
    labels = torch.randint(0, 7, (5,), generator=gen)
    a = draft.clone().requires_grad_(True)
    tv_ce(a, target, labels)[0].sum().backward()
    b = draft.clone().requires_grad_(True)
    _reference_tv_ce(b, target, labels)[0].sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_logit_gram_mse_equals_the_vocabulary_sum():
    """The Gram-matrix MSE is exactly the mean over the vocabulary of the squared difference
    of centred logits, Markov bias included (tiny V so the direct sum is cheap)."""
    from sglang_dspark.drafter.training.loss import LogitGram

    gen = torch.Generator().manual_seed(3)
    V, H, r = 50, 8, 4
    lm = torch.randn(V, H, generator=gen, dtype=torch.float64)
    w2 = torch.randn(V, r, generator=gen, dtype=torch.float64)
    h = torch.randn(3, 2, H, generator=gen, dtype=torch.float64)
    t = torch.randn(3, 2, H, generator=gen, dtype=torch.float64)
    z = torch.randn(3, 2, r, generator=gen, dtype=torch.float64)
    gram = LogitGram(lm)
    got = gram.mse(h - t, z, w2)
    draft = h @ lm.T + z @ w2.T
    target = t @ lm.T
    diff = (draft - draft.mean(-1, keepdim=True)) - (target - target.mean(-1, keepdim=True))
    want = (diff**2).mean(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert (got > 0).all()


def test_logit_gram_mse_gradient_reaches_w2():
    from sglang_dspark.drafter.training.loss import LogitGram

    gen = torch.Generator().manual_seed(4)
    lm = torch.randn(30, 6, generator=gen)
    w2 = torch.randn(30, 3, generator=gen, requires_grad=True)
    LogitGram(lm).mse(
        torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen), w2
    ).sum().backward()
    assert w2.grad is not None and w2.grad.abs().sum() > 0


def _reference_bucketed_tv(draft, target_logits, k):
    """Autograd reference of the top-k TV: S = the target's k most likely tokens, the rest of
    the vocabulary one bucket."""
    p_d, p_t = torch.softmax(draft.double(), -1), torch.softmax(target_logits.double(), -1)
    ids = p_t.topk(k, dim=-1).indices
    pd_s, pt_s = p_d.gather(-1, ids), p_t.gather(-1, ids)
    q_out, p_out = 1 - pd_s.sum(-1), 1 - pt_s.sum(-1)
    return (pd_s - pt_s).abs().sum(-1) + (q_out - p_out).abs(), q_out, p_out


def test_top_k_tv_is_the_bucketed_bound_with_its_exact_gradient(monkeypatch):
    """The top-k TV/CE equals an autograd reference of the bucketed TV (values and gradients,
    over several chunks); it is a lower bound of the full TV, low by at most 2 min(Q_out,
    P_out); CE is unchanged; with k = V it is the full TV exactly."""
    from sglang_dspark.drafter.training import loss as loss_mod
    from sglang_dspark.drafter.training.loss import TargetTopK

    monkeypatch.setattr(loss_mod, "_CHUNK_ROWS", 3)
    gen = torch.Generator().manual_seed(2)
    vocab, k = 13, 4
    draft = torch.randn(4, 2, vocab, generator=gen, dtype=torch.float64) * 2
    target = torch.randn(4, 2, vocab, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, vocab, (4, 2), generator=gen)
    w_tv = torch.rand(4, 2, generator=gen, dtype=torch.float64)
    w_ce = torch.rand(4, 2, generator=gen, dtype=torch.float64)

    top = TargetTopK.from_logits(target, k)
    assert top.ids.shape == (4, 2, k) and top.ids.dtype == torch.int32
    a = draft.clone().requires_grad_(True)
    tv, ce = loss_mod.tv_ce(a, top, labels)
    ((tv * w_tv).sum() + (ce * w_ce).sum()).backward()

    b = draft.clone().requires_grad_(True)
    tv_ref, q_out, p_out = _reference_bucketed_tv(b, target, k)
    ce_ref = _reference_tv_ce(b, target, labels)[1]
    ((tv_ref * w_tv).sum() + (ce_ref * w_ce).sum()).backward()
    torch.testing.assert_close(tv.double(), tv_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce.double(), ce_ref.detach().double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)

    full_tv = loss_mod.tv_ce(draft, target, labels)[0].double()
    slack = 2 * torch.minimum(q_out, p_out).detach()
    assert (tv.double() <= full_tv + 1e-6).all()
    assert (tv.double() >= full_tv - slack - 1e-6).all()
    assert (full_tv - tv.double()).max() > 1e-3  # the bound is not trivially exact here

    everything = TargetTopK.from_logits(target, vocab)
    torch.testing.assert_close(loss_mod.tv_ce(draft, everything, labels)[0], full_tv.float(),
                               rtol=1e-5, atol=1e-6)  # fmt: skip

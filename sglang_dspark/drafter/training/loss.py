"""The DSpark training loss: three terms over block positions k = 1..gamma.

    L = 0.1 * CE + 0.9 * TV + 1.0 * CONF,  each  sum_k w_k * term_k / sum_k w_k

    w_k    = exp(-(k-1) / decay)            (DeepSpec: decay 4.0 with gamma 7)
    CE_k   = -log p_d,k(x_k)                (x_k: the target's own continuation)
    TV_k   = || p_d,k - p_t,k ||_1          (the L1 distance; expected acceptance is 1 - TV_k/2)
    CONF_k = BCE( c_k, c*_k ),  c*_k = 1 - 0.5 || p_d,k - p_t,k ||_1  (detached soft label)

p_d,k = softmax(U_k + B_k) is the drafter's corrected distribution (teacher-forced Markov
head), p_t,k the target's at the same position. Positions past the end of the sequence or off
the loss mask (and everything after the first such position in a block) get weight 0.

TV and CE share one pass over the vocabulary (:class:`_TvCe`): rows are processed in chunks,
nothing [N, gamma, V]-sized is kept in fp32, and the backward recomputes the softmaxes chunk by
chunk with the closed-form gradients

    d TV / d z = p_d * (s - <p_d, s>),  s = sign(p_d - p_t);     d CE / d z = p_d - onehot(x).

Optional dense term (``mse``, off by default): the mean squared error between the drafter's
and the target's centred logits over the WHOLE vocabulary,

    MSE_k = 1/V || C (W_lm h_k + W2 z_k - W_lm t_k) ||^2,   C = I - 11^T/V  (shift-invariant),

computed exactly in H + r dimensions through Gram matrices (:class:`LogitGram`): no
vocabulary-sized tensor at all. t_k is the target's final normed hidden state at the same
position, z_k the Markov head's rank-r code (B_k = W2 z_k). Its cost per block is a small
fraction of TV/CE's, so it can supervise many more blocks per step ("dense anchors").

Top-k targets (``TargetTopK``, the trainer's ``target_topk``): instead of the target's logits
over the whole vocabulary at every step, its k most likely tokens S and their log-probabilities
(under the full softmax, computed once per sequence with its features). The rest of the
vocabulary is one bucket of target mass P_out = 1 - p_t(S) and draft mass Q_out = 1 - p_d(S):

    TV_k ~ sum_{v in S} |p_d(v) - p_t(v)| + |Q_out - P_out|

a lower bound of the full TV, low by at most 2 min(Q_out, P_out) (exact when P_out = 0). The
gradient keeps the closed form above with s(v) = sign(Q_out - P_out) outside S. A step then
needs no target LM head and no softmax of the target.

Terms are returned as sums so that data-parallel ranks and micro-batches can share one
global normaliser (sum of w_k over the global batch): the gradient then does not depend on
how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    decay: float = 4.0  # w_k = exp(-(k-1)/decay); <= 0 means uniform weights
    mse: float = 0.0  # dense centred-logit MSE (its own normaliser, see combine())


def position_weights(
    block_size: int, decay: float, device: torch.device | None = None
) -> torch.Tensor:
    """w_1..w_gamma = exp(-(k-1)/decay), or ones when decay <= 0."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    if decay is None or decay <= 0:
        return torch.ones_like(k)
    return torch.exp(-k / float(decay))


@dataclass
class LossSums:
    """Weighted sums of the three terms, their weight total, and the acceptance proxy."""

    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    weight: torch.Tensor  # sum of w_k over supervised positions
    accept: torch.Tensor  # sum over supervised positions of 1 - TV_k / 2 (unweighted)
    count: torch.Tensor  # number of supervised positions
    mse: torch.Tensor  # sum of w_k * MSE_k over the blocks the MSE term supervises
    mse_weight: torch.Tensor  # sum of w_k over those positions

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def detached(self) -> LossSums:
        return LossSums(*(getattr(self, f.name).detach() for f in fields(self)))

    def as_tensor(self) -> torch.Tensor:
        return torch.stack([getattr(self, f.name).detach().float() for f in fields(self)])

    @classmethod
    def zeros(cls, device: torch.device | None = None) -> LossSums:
        return cls(*(torch.zeros((), device=device) for _ in fields(cls)))


# Rows per fp32 pass over the vocabulary in the TV/CE functions. Each pass is memory-bound: on
# a CPU a chunk small enough to stay in cache (8 rows x 49 152 x 4 B = 1.5 MiB) made TV/CE
# forward + backward 2.1x faster than 64 rows (1 344 rows of SmolLM2's vocabulary, bf16
# logits: 0.55 s -> 0.26 s on 2 cores, best of 5); on a GPU each chunk costs kernel launches: large.
_CHUNK_ROWS: int | None = None  # None: _DEVICE_CHUNK_ROWS for the tensor's device
_DEVICE_CHUNK_ROWS = {"cpu": 8, "cuda": 2048}


def _chunk_rows(t: torch.Tensor) -> int:
    return _CHUNK_ROWS or _DEVICE_CHUNK_ROWS.get(t.device.type, 256)


def _tv_ce_grad(p_d, sign, g_tv, g_ce, labels):
    """d(g_tv TV + g_ce CE)/dz = p_d (g_tv (s - <p_d, s>) + g_ce) - g_ce onehot(label)."""
    dot = (p_d * sign).sum(dim=-1, keepdim=True)
    g = p_d * (g_tv[:, None] * (sign - dot) + g_ce[:, None])
    return g.scatter_add_(-1, labels[:, None], -g_ce[:, None])


class _TvCe(torch.autograd.Function):
    """(TV, CE) per row of draft logits z [N, V] against target logits t [N, V] (any float
    dtype; computed in fp32 a chunk of rows at a time). Gradient flows to z only."""

    @staticmethod
    def forward(ctx, z, t, labels):  # type: ignore[override]
        n = z.shape[0]
        tv = torch.empty(n, dtype=torch.float32, device=z.device)
        ce = torch.empty(n, dtype=torch.float32, device=z.device)
        step = _chunk_rows(z)
        for i in range(0, n, step):
            sl = slice(i, i + step)
            log_pd = torch.log_softmax(z[sl].float(), dim=-1)
            p_t = torch.softmax(t[sl].float(), dim=-1)
            tv[sl] = (log_pd.exp() - p_t).abs().sum(dim=-1)
            ce[sl] = -log_pd.gather(-1, labels[sl, None]).squeeze(-1)
        ctx.save_for_backward(z, t, labels)
        return tv, ce

    @staticmethod
    def backward(ctx, g_tv, g_ce):  # type: ignore[override]
        z, t, labels = ctx.saved_tensors
        n = z.shape[0]
        g_tv = torch.zeros(n, device=z.device) if g_tv is None else g_tv.float()
        g_ce = torch.zeros(n, device=z.device) if g_ce is None else g_ce.float()
        grad = torch.empty_like(z)
        step = _chunk_rows(z)
        for i in range(0, n, step):
            sl = slice(i, i + step)
            p_d = torch.softmax(z[sl].float(), dim=-1)
            sign = torch.sign(p_d - torch.softmax(t[sl].float(), dim=-1))
            grad[sl] = _tv_ce_grad(p_d, sign, g_tv[sl], g_ce[sl], labels[sl]).to(grad.dtype)
        return grad, None, None


@dataclass(frozen=True)
class TargetTopK:
    """The target's distribution at some positions as its k most likely tokens: ids [..., k]
    and their log-probabilities logp [..., k] under the full softmax (mass <= 1)."""

    ids: torch.Tensor
    logp: torch.Tensor

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int, *, chunk_rows: int = 256) -> TargetTopK:
        """Top-k of log_softmax(logits) over the last dim, a chunk of rows at a time."""
        flat = logits.reshape(-1, logits.shape[-1])
        ids, logp = [], []
        for i in range(0, flat.shape[0], chunk_rows):
            v, j = torch.log_softmax(flat[i : i + chunk_rows].float(), dim=-1).topk(k, dim=-1)
            ids.append(j.to(torch.int32))
            logp.append(v)
        lead = (*logits.shape[:-1], k)
        if not ids:
            return cls(flat.new_zeros(lead, dtype=torch.int32), flat.new_zeros(lead).float())
        return cls(torch.cat(ids).view(lead), torch.cat(logp).view(lead))

    def __getitem__(self, index) -> TargetTopK:
        return TargetTopK(self.ids[index], self.logp[index])


def _bucket_terms(log_pd: torch.Tensor, ids: torch.Tensor, logp_t: torch.Tensor):
    """Per row: p_d on S, p_t on S, and the sign of (Q_out - P_out) for the rest."""
    pd_s = log_pd.gather(-1, ids).exp()
    pt_s = logp_t.float().exp()
    q_out = (1.0 - pd_s.sum(-1, keepdim=True)).clamp_min(0.0)
    p_out = (1.0 - pt_s.sum(-1, keepdim=True)).clamp_min(0.0)
    return pd_s, pt_s, q_out, p_out


class _TvCeTopK(torch.autograd.Function):
    """(TV over S plus one bucket, CE) per row of draft logits z [N, V] against the target's
    top-k ids / log-probabilities [N, k]. Gradient flows to z only."""

    @staticmethod
    def forward(ctx, z, ids, logp_t, labels):  # type: ignore[override]
        n = z.shape[0]
        tv = torch.empty(n, dtype=torch.float32, device=z.device)
        ce = torch.empty(n, dtype=torch.float32, device=z.device)
        step = _chunk_rows(z)
        for i in range(0, n, step):
            sl = slice(i, i + step)
            log_pd = torch.log_softmax(z[sl].float(), dim=-1)
            pd_s, pt_s, q_out, p_out = _bucket_terms(log_pd, ids[sl], logp_t[sl])
            tv[sl] = (pd_s - pt_s).abs().sum(-1) + (q_out - p_out).abs().squeeze(-1)
            ce[sl] = -log_pd.gather(-1, labels[sl, None]).squeeze(-1)
        ctx.save_for_backward(z, ids, logp_t, labels)
        return tv, ce

    @staticmethod
    def backward(ctx, g_tv, g_ce):  # type: ignore[override]
        z, ids, logp_t, labels = ctx.saved_tensors
        n = z.shape[0]
        g_tv = torch.zeros(n, device=z.device) if g_tv is None else g_tv.float()
        g_ce = torch.zeros(n, device=z.device) if g_ce is None else g_ce.float()
        grad = torch.empty_like(z)
        step = _chunk_rows(z)
        for i in range(0, n, step):
            sl = slice(i, i + step)
            log_pd = torch.log_softmax(z[sl].float(), dim=-1)
            p_d = log_pd.exp()
            pd_s, pt_s, q_out, p_out = _bucket_terms(log_pd, ids[sl], logp_t[sl])
            sign = torch.sign(q_out - p_out).expand_as(p_d).clone()
            sign.scatter_(-1, ids[sl], torch.sign(pd_s - pt_s))
            grad[sl] = _tv_ce_grad(p_d, sign, g_tv[sl], g_ce[sl], labels[sl]).to(grad.dtype)
        return grad, None, None, None


def tv_ce(
    draft_logits: torch.Tensor,
    target: torch.Tensor | TargetTopK,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """||softmax(draft) - p_t||_1 and -log softmax(draft)[label] over the last dim; leading
    dims are kept. ``target``: the target's logits [..., V], or its top-k (the TV is then the
    bucketed lower bound, see the module docstring). Memory: one chunk of rows in fp32."""
    lead, vocab = draft_logits.shape[:-1], draft_logits.shape[-1]
    z = draft_logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1).long()
    if isinstance(target, TargetTopK):
        k = target.ids.shape[-1]
        tv, ce = _TvCeTopK.apply(
            z, target.ids.reshape(-1, k).long(), target.logp.reshape(-1, k), flat_labels
        )
    else:
        tv, ce = _TvCe.apply(z, target.reshape(-1, vocab), flat_labels)
    return tv.view(lead), ce.view(lead)


def loss_sums(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor | TargetTopK,
    labels: torch.Tensor,
    valid: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    *,
    decay: float,
) -> LossSums:
    """draft_logits / target_logits [N, gamma, V] (or the target's top-k [N, gamma, k]);
    labels, valid, confidence_logits [N, gamma]."""
    gamma = draft_logits.shape[1]
    w = position_weights(gamma, decay, draft_logits.device) * valid.float()  # [N, gamma]
    tv, ce = tv_ce(draft_logits, target_logits, labels)  # ||p_d - p_t||_1, -log p_d(x)
    if confidence_logits is not None:
        c_star = (1.0 - 0.5 * tv.detach()).clamp(0.0, 1.0)
        conf = F.binary_cross_entropy_with_logits(
            confidence_logits.float(), c_star, reduction="none"
        )
        conf_sum = (conf * w).sum()
    else:
        conf_sum = w.new_zeros(())
    vf = valid.float()
    return LossSums(
        ce=(ce * w).sum(),
        tv=(tv * w).sum(),
        conf=conf_sum,
        weight=w.sum(),
        accept=((1.0 - 0.5 * tv.detach()) * vf).sum(),
        count=vf.sum(),
        mse=w.new_zeros(()),
        mse_weight=w.new_zeros(()),
    )


def combine(
    sums: LossSums,
    weights: LossWeights,
    weight_total: torch.Tensor,
    mse_weight_total: torch.Tensor | None = None,
) -> torch.Tensor:
    """0.1 CE + 0.9 TV + 1.0 CONF, normalised by the (global) weight total, plus
    ``weights.mse`` x the MSE sum over its own (global) weight total."""
    denom = weight_total.clamp_min(1e-6)
    loss = (weights.ce * sums.ce + weights.tv * sums.tv + weights.conf * sums.conf) / denom
    if weights.mse and mse_weight_total is not None:
        loss = loss + weights.mse * sums.mse / mse_weight_total.clamp_min(1e-6)
    return loss


class LogitGram:
    """Centred-logit MSE through Gram matrices of the frozen LM head W_lm [V, H] and the
    Markov head's W2 [V, r]. W_lm's Gram is computed once; W2's parts every call (it trains)."""

    def __init__(self, lm_head_weight: torch.Tensor) -> None:
        w = lm_head_weight.detach().float()
        self.vocab = w.shape[0]
        self.w_c = w - w.mean(dim=0, keepdim=True)  # C W_lm
        self.g_hh = self.w_c.T @ self.w_c / self.vocab  # [H, H]

    def mse(self, diff: torch.Tensor, codes: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """diff = h - t [..., H], codes = z [..., r], w2 [V, r]: MSE [...] (fp32)."""
        w2_c = w2.float() - w2.float().mean(dim=0, keepdim=True)
        g_hz = self.w_c.T @ w2_c / self.vocab  # [H, r]
        g_zz = w2_c.T @ w2_c / self.vocab  # [r, r]
        d, z = diff.float(), codes.float()
        return (
            ((d @ self.g_hh) * d).sum(-1)
            + 2.0 * ((d @ g_hz) * z).sum(-1)
            + ((z @ g_zz) * z).sum(-1)
        )

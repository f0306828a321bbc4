"""Lossless rejection sampling for a chain of draft tokens, in torch.

The math (DSPARK.md section 1): at draft position k accept x_k with probability
min(1, p_t(x_k) / p_d(x_k)); at the first rejection sample the replacement from
norm(max(0, p_t - p_d)) and drop the rest; if every draft is accepted, sample the bonus token
from p_t at the position after the last draft. The output distribution equals the target's.

`chain_rejection_sample` is the readable reference used by tests and the offline evaluator.
`chain_speculative_sampling_torch` has the exact signature and buffer layout of SGLang's
Triton kernel `chain_speculative_sampling_triton`, so the plugin can swap it in on CPU.
"""

from __future__ import annotations

import torch

# Deliberately broken samplers, for negative controls only (the losslessness tests and
# `sglang-dspark audit` must catch each; on a test server the test-only plugin in
# tests/controls selects one, never the shipped hooks):
BROKEN_MODES = {
    "accept_all": "every draft kept",
    "no_renorm": "replacement drawn from max(0, p_t - p_d) without renormalising it",
    "bonus_from_draft": "bonus token drawn from the last draft distribution instead of p_t",
    "ratio_scaled": "acceptance ratio p_t / p_d multiplied by 1.3 (ratio_scaled:C for another C)",
}


def parse_broken_mode(mode: str | None) -> tuple[str | None, float]:
    """'ratio_scaled:0.7' -> ('ratio_scaled', 0.7); None / '' -> (None, 1.0)."""
    if not mode:
        return None, 1.0
    name, _, value = mode.partition(":")
    if name not in BROKEN_MODES or (value and name != "ratio_scaled"):
        raise ValueError(
            f"unknown broken sampler mode {mode!r}; choose one of {', '.join(BROKEN_MODES)} "
            "(ratio_scaled:C sets the factor)"
        )
    try:
        scale = float(value) if value else 1.3
    except ValueError:
        raise ValueError(
            f"ratio_scaled:{value}: the factor must be a number, e.g. ratio_scaled:0.7"
        ) from None
    return name, scale


def _residual(p_t: torch.Tensor, p_d: torch.Tensor) -> torch.Tensor:
    """max(0, p_t - p_d); a non-probability p_d (NaN, inf, < 0) counts as 0."""
    p_d = torch.where((p_d >= 0) & (p_d <= 1), p_d, torch.zeros_like(p_d))
    return (p_t - p_d).clamp_min(0)


def _sample_cdf(
    weights: torch.Tensor, coins: torch.Tensor, renormalise: bool = True
) -> torch.Tensor:
    """Inverse-CDF sampling of each row of unnormalised `weights` with uniform `coins`."""
    cdf = weights.cumsum(-1)
    target = coins * cdf[:, -1] if renormalise else coins  # not renormalising: broken on purpose
    hit = cdf > target[:, None]
    token = hit.int().argmax(-1)
    # A degenerate row (all zero) falls back to the last id, as the Triton kernel does.
    return torch.where(hit.any(-1), token, torch.full_like(token, weights.shape[-1] - 1))


def accept_lengths(
    drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    coins: torch.Tensor,
    ratio_scale: float = 1.0,
) -> torch.Tensor:
    """Number of accepted leading drafts per request.

    drafts [bs, g]; target_probs [bs, >=g, V]; draft_probs [bs, g, V]; coins [bs, g] uniform.
    `ratio_scale` != 1 is the broken `ratio_scaled` mode (tests only).
    """
    g = drafts.shape[1]
    idx = drafts.long().unsqueeze(-1)
    p = target_probs[:, :g].float().gather(-1, idx).squeeze(-1)
    q = draft_probs[:, :g].float().gather(-1, idx).squeeze(-1)
    ok = (q > 0) & (q <= 1) & (coins * q < p * ratio_scale)
    return ok.int().cumprod(1).sum(1)


def chain_rejection_sample(
    drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [bs], next_token [bs]): the replacement or bonus token."""
    bs, g = drafts.shape
    coins = torch.rand(bs, g, generator=generator, device=drafts.device)
    final_coins = torch.rand(bs, generator=generator, device=drafts.device)
    n = accept_lengths(drafts, target_probs, draft_probs, coins)
    return n, _final_token(n, target_probs, draft_probs, final_coins)


def _final_token(
    n, target_probs, draft_probs, final_coins, broken: str | None = None
) -> torch.Tensor:
    bs, g = draft_probs.shape[:2]
    rows = torch.arange(bs, device=n.device)
    p_t = target_probs[rows, n.long()].float()
    p_d = draft_probs[rows, n.clamp(max=g - 1).long()].float()
    all_accepted = (n == g)[:, None]
    bonus = p_d if broken == "bonus_from_draft" else p_t  # the broken mode reuses the last p_d
    weights = torch.where(all_accepted, bonus, _residual(p_t, p_d))
    if broken == "no_renorm":  # the bonus row sums to 1 already; only the residual is hit
        return torch.where(
            all_accepted[:, 0],
            _sample_cdf(weights, final_coins),
            _sample_cdf(weights, final_coins, renormalise=False),
        )
    return _sample_cdf(weights, final_coins)


def chain_speculative_sampling_torch(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single,
    threshold_acc,
    deterministic,
    *,
    block_verification: bool = False,
    accept_all: bool = False,
    broken: str | None = None,
):
    """Drop-in for SGLang's `chain_speculative_sampling_triton` (same buffers, same coins).

    candidates [bs, n] hold [anchor, draft_1..draft_{n-1}]; retrive_index [bs, n] the global
    slot of each; on return predicts[slot j] is the token that follows slot j on the accepted
    path, accept_index[:, :k+1] the accepted slots and accept_token_num the k accepted drafts.
    `broken` (a `BROKEN_MODES` name; `accept_all=True` is `broken="accept_all"`) breaks
    losslessness on purpose so that tests can show that their test catches it.
    """
    mode, scale = parse_broken_mode("accept_all" if accept_all else broken)
    if block_verification:
        raise NotImplementedError("block verification has no CPU implementation")
    if threshold_single != 1.0 or threshold_acc != 1.0:
        raise NotImplementedError("relaxed acceptance thresholds are not lossless; use 1.0")
    bs, n_slots = candidates.shape
    drafts = candidates[:, 1:]
    g = n_slots - 1
    coins = uniform_samples[:, :g].float()
    n = accept_lengths(
        drafts, target_probs, draft_probs, coins, scale if mode == "ratio_scaled" else 1.0
    )
    if mode == "accept_all":  # deliberately broken (tests only): keeps every draft, not lossless
        n = torch.full_like(n, g)
    final = _final_token(
        n, target_probs, draft_probs, uniform_samples_for_final_sampling.float(), mode
    )

    slots = retrive_index[:bs, :n_slots].long()
    cols = torch.arange(n_slots, device=candidates.device)
    on_path = cols[None, :] <= n[:, None]
    # the token after slot j is draft j+1 while accepted, then the final token
    nxt = torch.cat([drafts, final[:, None]], 1).to(predicts.dtype)
    nxt[torch.arange(bs), n.long()] = final.to(predicts.dtype)
    predicts[slots[on_path]] = nxt[on_path]
    accept_index[:bs, :n_slots] = torch.where(
        on_path, slots, accept_index[:bs, :n_slots].long()
    ).to(accept_index.dtype)
    accept_token_num[:bs] = n.to(accept_token_num.dtype)


def _softmax_rows(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """softmax(logits / t) per row in float32, with SGLang's `softmax_temp` arithmetic (so a
    row equals the row SGLang's sampler computes over the whole batch, bit for bit)."""
    return torch.softmax(logits.to(torch.float32) / temperatures[:, None], dim=-1)


def chain_accept_verified(
    drafts: torch.Tensor,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    target_temperatures: torch.Tensor,
    draft_temperatures: torch.Tensor,
    verify_lens: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    *,
    draft_vocab: torch.Tensor | None = None,
    broken: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rejection sampling over the rows each request verifies, and no others.

    drafts [bs, g]; target_logits [bs, >= g + 1, V]; draft_logits [bs, g, V] (None: a greedy
    draft, one-hot at its token); temperatures [bs]; verify_lens [bs] in 1..g+1, the anchor
    included (request r checks drafts 1..L_r-1); coins [bs, g] and final_coins [bs] uniform.
    Returns (accepted drafts n [bs], next token [bs]).

    Softmaxes only the L_r - 1 target and draft rows that check a draft, then one target row
    (and, after a rejection, one draft row) per request for the next token: the residual
    norm(max(0, p_t - p_d)) at the first rejection, else a sample of p_t at row L_r - 1.
    Where L_r = g + 1 this is `chain_rejection_sample` on the same coins, token for token.
    Where a request verifies fewer drafts than were drafted, the draft after its window is
    never read: its next token is drawn from the target at the window's end (SGLang's sampler
    checks one draft more and then caps; both draw that token from p_t). `broken` is a
    `BROKEN_MODES` name (negative controls only). `draft_vocab` [N] (target ids, ascending):
    the draft logits are over those tokens only ([bs, g, N]), the draft distribution is 0 on
    every other token.
    """
    mode, scale = parse_broken_mode(broken)
    bs, g = drafts.shape
    device = drafts.device
    limit = verify_lens.to(device=device, dtype=torch.int64).clamp(1, g + 1) - 1  # drafts checked
    cols = torch.arange(g, device=device)
    r, j = (cols[None, :] < limit[:, None]).nonzero(as_tuple=True)
    x = drafts[r, j].long()[:, None]
    p = _softmax_rows(target_logits[r, j], target_temperatures[r]).gather(1, x)[:, 0]
    vocab = target_logits.shape[-1]
    if draft_vocab is not None:
        where = torch.full((vocab,), -1, dtype=torch.int64, device=device)
        where[draft_vocab] = torch.arange(len(draft_vocab), device=device)
    if draft_logits is None:
        q = torch.ones_like(p)
    elif draft_vocab is None:
        q = _softmax_rows(draft_logits[r, j], draft_temperatures[r]).gather(1, x)[:, 0]
    else:  # the draft's column of x, 0 where x is outside the draft vocabulary
        col = where[x[:, 0]]
        q = _softmax_rows(draft_logits[r, j], draft_temperatures[r])
        q = torch.where(col >= 0, q.gather(1, col.clamp(min=0)[:, None])[:, 0], 0.0)
    ok = torch.zeros(bs, g, dtype=torch.bool, device=device)
    ok[r, j] = (q > 0) & (q <= 1) & (coins[r, j].float() * q < p * scale)
    n = ok.to(torch.int64).cumprod(1).sum(1)
    if mode == "accept_all":  # deliberately broken (tests only)
        n = limit.clone()

    rows = torch.arange(bs, device=device)
    p_t = _softmax_rows(target_logits[rows, n], target_temperatures)
    rejected = n < limit
    draft_row = torch.where(rejected, n, n - 1).clamp(0, g - 1)  # broken mode: the last draft
    if draft_logits is None:
        p_d = torch.zeros_like(p_t).scatter_(1, drafts[rows, draft_row].long()[:, None], 1.0)
    else:
        p_d = _softmax_rows(draft_logits[rows, draft_row], draft_temperatures)
        if draft_vocab is not None:
            p_d = torch.zeros_like(p_t).index_copy_(1, draft_vocab, p_d)
    bonus = p_d if mode == "bonus_from_draft" else p_t
    weights = torch.where(rejected[:, None], _residual(p_t, p_d), bonus)
    final_coins = final_coins.float()
    if mode == "no_renorm":
        token = torch.where(
            rejected,
            _sample_cdf(weights, final_coins, renormalise=False),
            _sample_cdf(weights, final_coins),
        )
    else:
        token = _sample_cdf(weights, final_coins)
    return n, token

"""The sampled DSPARK accept over verified rows only (`rejection.chain_accept_verified`, hook
`cpu_verified_rows_accept`): token for token SGLang's chain sampler where a window covers the
block, the same acceptances inside shorter windows, and lossless with windows of any length
(the audit's comparison against exact target sampling; the broken controls are caught)."""

from __future__ import annotations

import pytest
import torch

from sglang_dspark.verification.losslessness import compare_samples
from sglang_dspark.verification.rejection import (
    chain_accept_verified,
    chain_speculative_sampling_torch,
)

V, G = 40, 7


def _block(bs: int, seed: int, *, temperature: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(bs, G + 1, V, generator=g) * 2.5
    draft = target[:, :G] + torch.randn(bs, G, V, generator=g)
    temps = torch.full((bs,), temperature)
    drafts = torch.multinomial((draft / temperature).softmax(-1).view(-1, V), 1, generator=g)
    drafts = drafts.view(bs, G)
    coins = torch.rand(bs, G, generator=g)
    final = torch.rand(bs, generator=g)
    return target, draft, temps, drafts, coins, final


def _upstream(target, draft, temps, drafts, coins, final, greedy_draft=False):
    """SGLang's path on CPU: softmax every row, the chain sampler over the whole block."""
    bs = drafts.shape[0]
    slots = G + 1
    p_t = torch.softmax(target / temps[:, None, None], -1)
    if greedy_draft:
        p_d = torch.zeros(bs, G, V).scatter_(-1, drafts[..., None], 1.0)
    else:
        p_d = torch.softmax(draft / temps[:, None, None], -1)
    predicts = torch.zeros(bs * slots, dtype=torch.int32)
    accept_index = torch.zeros(bs, slots, dtype=torch.int32)
    accepted = torch.zeros(bs, dtype=torch.int32)
    retrive = torch.arange(bs * slots).view(bs, slots)
    candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.long), drafts], 1)
    chain_speculative_sampling_torch(
        predicts, accept_index, accepted, candidates, retrive, None, None, coins, final,
        p_t, p_d, 1.0, 1.0, True,
    )  # fmt: skip
    n = accepted.long()
    return n, predicts[retrive[torch.arange(bs), n]].long()


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_full_windows_give_sglangs_tokens_on_the_same_coins(temperature, greedy_draft):
    target, draft, temps, drafts, coins, final = _block(256, 0, temperature=temperature)
    full = torch.full((256,), G + 1)
    n, token = chain_accept_verified(
        drafts, target, None if greedy_draft else draft, temps, temps, full, coins, final
    )
    n_ref, token_ref = _upstream(target, draft, temps, drafts, coins, final, greedy_draft)
    assert torch.equal(n, n_ref)
    assert torch.equal(token, token_ref)
    assert 0 < int(n.sum()) < 256 * G  # the case exercises both accepts and rejections


def test_short_windows_keep_the_acceptances_inside_them():
    """A window of L slots checks drafts 1..L-1 with the same coins: the accepted count is
    SGLang's capped count, and a rejection inside the window draws the same replacement."""
    bs = 512
    target, draft, temps, drafts, coins, final = _block(bs, 1)
    lens = torch.randint(1, G + 2, (bs,), generator=torch.Generator().manual_seed(2))
    n, token = chain_accept_verified(drafts, target, draft, temps, temps, lens, coins, final)
    n_ref, token_ref = _upstream(target, draft, temps, drafts, coins, final)
    assert torch.equal(n, torch.minimum(n_ref, lens - 1))
    inside = n_ref < lens - 1
    assert inside.any() and (~inside).any()
    assert torch.equal(token[inside], token_ref[inside])


def test_rows_after_a_window_are_never_read():
    """NaN in every draft and target row past each window changes nothing (the draft pass may
    leave them undrafted)."""
    bs = 64
    target, draft, temps, drafts, coins, final = _block(bs, 3)
    lens = torch.randint(1, G + 2, (bs,), generator=torch.Generator().manual_seed(4))
    n, token = chain_accept_verified(drafts, target, draft, temps, temps, lens, coins, final)
    cols = torch.arange(G + 1)
    spoilt_t = target.masked_fill((cols[None, :] >= lens[:, None])[..., None], float("nan"))
    spoilt_d = draft.masked_fill((cols[None, :G] >= (lens - 1)[:, None])[..., None], float("nan"))
    spoilt_x = drafts.masked_fill(cols[None, :G] >= (lens - 1)[:, None], V + 5)
    n2, token2 = chain_accept_verified(spoilt_x, spoilt_t, spoilt_d, temps, temps, lens, coins,
                                       final)  # fmt: skip
    assert torch.equal(n, n2) and torch.equal(token, token2)


# ---------------------------------------------------------------- lossless with any window
PROMPTS, LENGTH, SAMPLES = 3, 4, 240


def _chain_model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g) * 3.0
    draft = logits + torch.randn(V, V, generator=g)
    start = torch.randn(PROMPTS, V, generator=g) * 3.0
    return logits, draft, start.softmax(-1)


def _continuations(logits, draft, p_0, n, gen, broken=None, gamma=3, ids=None):
    """Order-1 Markov target and draft; rounds of `gamma` drafts, each request verifying a
    random window of 1..gamma+1 slots, accepted by `chain_accept_verified`. With `ids` the
    draft proposes from those tokens only (its logits over them: a draft vocabulary)."""
    if ids is not None:
        draft = draft[:, ids]
    rows = torch.arange(n)
    out = torch.full((n, LENGTH + gamma + 1), -1, dtype=torch.long)
    out[:, 0] = torch.multinomial(p_0.expand(n, -1), 1, generator=gen)[:, 0]
    length = torch.ones(n, dtype=torch.long)
    temps = torch.ones(n)
    while (length < LENGTH).any():
        cur = out[rows, length - 1]
        chain, drafts = [cur], []
        for _ in range(gamma):
            cur = torch.multinomial(draft[cur].softmax(-1), 1, generator=gen)[:, 0]
            cur = cur if ids is None else ids[cur]
            drafts.append(cur)
            chain.append(cur)
        drafts = torch.stack(drafts, 1)
        chain = torch.stack(chain, 1)
        lens = torch.randint(1, gamma + 2, (n,), generator=gen)
        k, token = chain_accept_verified(
            drafts, logits[chain], draft[chain[:, :gamma]], temps, temps, lens,
            torch.rand(n, gamma, generator=gen), torch.rand(n, generator=gen), broken=broken,
            draft_vocab=ids,
        )  # fmt: skip
        tokens = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
        tokens[rows, k] = token
        for j in range(gamma + 1):
            write = (j <= k) & (length < LENGTH)
            out[rows[write], length[write]] = tokens[write, j]
            length = length + write.long()
    return out[:, :LENGTH].tolist()


def _reference(logits, p_0, n, gen):
    x = torch.multinomial(p_0.expand(n, -1), 1, generator=gen)
    for _ in range(LENGTH - 1):
        x = torch.cat([x, torch.multinomial(logits[x[:, -1]].softmax(-1), 1, generator=gen)], 1)
    return x.tolist()


def _audit(broken, seed):
    logits, draft, p_0 = _chain_model()
    gen = torch.Generator().manual_seed(200 + seed)
    test = [_continuations(logits, draft, p_0[i], SAMPLES, gen, broken) for i in range(PROMPTS)]
    ref = [_reference(logits, p_0[i], SAMPLES, gen) for i in range(PROMPTS)]
    return compare_samples(test, ref, [1, 2, 3], joint_positions=(0, 1, 2), alpha=0.01)


def test_random_windows_are_lossless():
    for seed in range(3):
        report = _audit(None, seed)
        assert report.passed, report.summary()


@pytest.mark.parametrize("mode", ["accept_all", "no_renorm", "bonus_from_draft"])
def test_broken_modes_are_caught(mode):
    for seed in range(2):
        report = _audit(mode, seed)
        assert not report.passed, f"{mode}, seed {seed}: {report.summary()}"


# ---------------------------------------------------------------- a reduced draft vocabulary
def test_a_draft_vocabulary_is_the_full_one_with_the_rest_at_zero():
    """Draft logits over N ids give the tokens the full-width call gives with every other
    logit at -inf (the draft distribution 0 there), on the same coins."""
    bs = 256
    target, draft, temps, _, coins, final = _block(bs, 5)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(6))[:24].sort().values
    gen = torch.Generator().manual_seed(7)
    sub = draft[..., ids]
    drafts = ids[torch.multinomial(sub.softmax(-1).view(-1, len(ids)), 1, generator=gen)]
    drafts = drafts.view(bs, G)
    drafts[0, 0] = next(t for t in range(V) if t not in ids.tolist())
    lens = torch.randint(1, G + 2, (bs,), generator=gen)
    full = torch.full_like(draft, float("-inf"))
    full[..., ids] = sub
    n, token = chain_accept_verified(drafts, target, sub, temps, temps, lens, coins, final,
                                     draft_vocab=ids)  # fmt: skip
    n_ref, token_ref = chain_accept_verified(drafts, target, full, temps, temps, lens, coins, final)
    assert torch.equal(n, n_ref) and torch.equal(token, token_ref)
    assert int(n[0]) == 0 or int(lens[0]) == 1  # a token the draft cannot propose is rejected


def test_a_draft_vocabulary_is_lossless():
    """Half the tokens in the draft vocabulary: the continuations are still the target's."""
    logits, draft, p_0 = _chain_model()
    ids = torch.arange(0, V, 2)
    for seed in range(2):
        gen = torch.Generator().manual_seed(300 + seed)
        test = [_continuations(logits, draft, p_0[i], SAMPLES, gen, ids=ids)
                for i in range(PROMPTS)]  # fmt: skip
        ref = [_reference(logits, p_0[i], SAMPLES, gen) for i in range(PROMPTS)]
        report = compare_samples(test, ref, [1, 2, 3], joint_positions=(0, 1, 2), alpha=0.01)
        assert report.passed, report.summary()

"""`cpu_plain_rounds`' policy without a server: a batch drafts while drafting pays, decodes
plainly while it does not, and probes the other mode now and then (fake clock, fake rounds)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from sglang_dspark.plugin import plain_rounds
from sglang_dspark.plugin.plain_rounds import (
    HISTORY,
    PROBE_EVERY_SURE,
    PROBE_ROUNDS,
    PlainRoundPolicy,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(policy: PlainRoundPolicy, clock: Clock, bs: int, rounds: int, cost) -> list[bool]:
    """`rounds` decode rounds of `bs` requests; cost(plain) -> (seconds, tokens committed)."""
    chosen = []
    for _ in range(rounds):
        policy.round_started(bs)
        plain = policy.choose_plain(bs)
        seconds, tokens = cost(plain)
        clock.now += seconds
        policy.round_finished(plain, tokens)
        chosen.append(plain)
    return chosen


def costs(draft_s: float, plain_s: float, accept: float, bs: int):
    return lambda plain: (plain_s, bs) if plain else (draft_s, round(accept * bs))


def engine(draft_s, plain_s, accept, bs, *, seed=0, drift=0.3, period=300, switch=0.12):
    """Rounds as a CPU serves them: a drafted round commits a random number of tokens (each
    request its anchor plus each draft kept with probability `accept` - 1, up to 3), both modes'
    round times drift by a shared slow factor (up to `drift`, over `period` rounds) and carry 10%
    noise, and the first round after a change of mode costs `switch` more."""
    rng = random.Random(seed)
    state = {"k": 0, "last": None}

    def cost(plain: bool):
        k, last = state["k"], state["last"]
        state["k"], state["last"] = k + 1, plain
        shared = 1 + drift * math.sin(2 * math.pi * k / period)
        extra = 1 + switch if last is not None and last != plain else 1
        seconds = (plain_s if plain else draft_s) * shared * extra * rng.uniform(0.9, 1.1)
        if plain:
            return seconds, bs
        kept = sum(1 for _ in range(bs) for _ in range(3) if rng.random() < (accept - 1) / 3)
        return seconds, bs + kept

    return cost


def late_share(chosen: list[bool], plain: bool, skip: int = 200) -> float:
    late = chosen[skip:]
    return late.count(plain) / len(late)


# Once sure, the other mode runs PROBE_ROUNDS rounds in every PROBE_EVERY_SURE + PROBE_ROUNDS.
SURE_PROBE_SHARE = PROBE_ROUNDS / (PROBE_EVERY_SURE + PROBE_ROUNDS)


def test_drafting_that_pays_keeps_drafting_and_probes_plain_rarely():
    clock = Clock()
    policy = PlainRoundPolicy("auto", clock)
    # 4 requests: a drafted round 0.13 s for 1.8 tokens each, a plain one 0.09 s for 1 each
    chosen = run(policy, clock, 4, 600, costs(0.13, 0.09, 1.8, 4))
    assert chosen[: PROBE_ROUNDS - 1] == [False] * (PROBE_ROUNDS - 1)  # speculative first
    assert 0 < late_share(chosen, True) <= SURE_PROBE_SHARE + 0.01  # plain only as probes
    c = policy.comparisons[4]
    assert len(c.log_ratios) == HISTORY and c.sure()
    assert math.exp(c.mean()) == pytest.approx((7 / 0.13) / (4 / 0.09), rel=1e-6)


def test_drafting_that_does_not_pay_decodes_plainly_and_probes_drafting_rarely():
    clock = Clock()
    policy = PlainRoundPolicy("auto", clock)
    chosen = run(policy, clock, 1, 600, costs(0.05, 0.04, 1.15, 1))
    assert 0 < late_share(chosen, False) <= SURE_PROBE_SHARE + 0.01
    ratio = math.exp(policy.comparisons[1].mean())
    assert ratio == pytest.approx((1 / 0.05) / (1 / 0.04))
    assert policy.summary() == f"bs 1: drafted / plain {ratio:.2f} ({HISTORY} comparisons)"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shared_drift_of_the_round_time_and_noisy_tokens_do_not_fool_it(seed):
    """Drafting pays 1.2x throughout while both modes' round times swing by 30% and a drafted
    round's tokens vary by a third; the first round after a switch costs 12% more (the EMA
    policy this replaces decoded plainly in 42% of such rounds on a CPU)."""
    clock = Clock()
    policy = PlainRoundPolicy("auto", clock)
    chosen = run(policy, clock, 4, 1500, engine(0.10, 0.08, 1.5, 4, seed=seed))
    assert late_share(chosen, True) <= SURE_PROBE_SHARE + 0.02  # the EMA policy: 0.10-0.12
    assert 0.1 < policy.comparisons[4].mean() < 0.3  # log(1.2) = 0.18
    # and the mirror image: drafting costs 15% and the drift is the same
    clock = Clock()
    policy = PlainRoundPolicy("auto", clock)
    chosen = run(policy, clock, 4, 1500, engine(0.10, 0.08, 1.08, 4, seed=seed))
    assert late_share(chosen, False) <= SURE_PROBE_SHARE + 0.02


def test_a_change_of_acceptance_is_followed():
    clock = Clock()
    policy = PlainRoundPolicy("auto", clock)
    run(policy, clock, 2, 300, costs(0.06, 0.04, 2.0, 2))  # pays: 66 vs 50 tok/s
    assert run(policy, clock, 2, 50, costs(0.06, 0.04, 2.0, 2))[-10:].count(True) <= PROBE_ROUNDS
    chosen = run(policy, clock, 2, 600, costs(0.06, 0.04, 1.1, 2))  # now 36 vs 50
    assert late_share(chosen, True, skip=400) >= 1 - SURE_PROBE_SHARE - 0.01
    assert policy.comparisons[2].mean() < 0


def test_batch_sizes_are_measured_apart_and_gaps_are_not_samples():
    clock = Clock()
    policy = PlainRoundPolicy("auto", clock)
    run(policy, clock, 1, 100, costs(0.05, 0.04, 1.1, 1))  # plain wins at 1
    run(policy, clock, 8, 100, costs(0.20, 0.15, 2.0, 8))  # drafting wins at 8
    assert policy.comparisons[8].mean() > 0 > policy.comparisons[1].mean()
    # a long gap (a prefill, an idle server) between two rounds is no round's cost
    c = policy.comparisons[8]
    before = (dict(c.last_rate), list(c.before), c.probe, c.after, list(c.log_ratios))
    policy.round_started(8)
    plain = policy.choose_plain(8)
    policy.round_finished(plain, 8 if plain else 16)
    clock.now += 30.0
    policy.round_started(8)
    assert (dict(c.last_rate), list(c.before), c.probe, c.after, list(c.log_ratios)) == before
    # rounds of a different batch size never pair up
    policy.round_finished(False, 16)
    clock.now += 0.2
    policy.round_started(3)
    assert 3 not in policy.comparisons


@pytest.mark.parametrize("value, plain", [("off", False), ("always", True)])
def test_fixed_modes(monkeypatch, value, plain):
    monkeypatch.setenv(plain_rounds.MODE_ENV, value)
    policy = PlainRoundPolicy(plain_rounds.mode(), Clock())
    assert [policy.choose_plain(bs) for bs in (1, 4, 16, 64)] == [plain] * 4


def test_a_bad_mode_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(plain_rounds.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="SGLANG_DSPARK_PLAIN_ROUNDS='sometimes'.*auto, off"):
        plain_rounds.mode()


def test_plain_rounds_need_compact_verify_and_stay_exact_if_filler_is_verified():
    """Only a `compact` step verifies what the scheduler asks for (a static step verifies every
    slot): elsewhere no round is made plain. Were a filler draft verified anyway, its proposal is
    the point mass it was drawn from, so the accept stays exact."""
    import torch
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftNoise

    assert not plain_rounds.compact_verify(None)
    assert not plain_rounds.compact_verify(SimpleNamespace(is_compact_mode=False))
    assert plain_rounds.compact_verify(SimpleNamespace(is_compact_mode=True))
    bs, gamma, vocab = 2, 5, 11
    ids = torch.zeros(bs, gamma + 1, dtype=torch.long)
    model = SimpleNamespace(
        markov_head=SimpleNamespace(vocab_size=vocab),
        confidence_head=SimpleNamespace(proj=torch.nn.Linear(4, 1).to(torch.bfloat16)),
    )
    proposer = SimpleNamespace(
        gamma=gamma, draft_model=model, sample_from_anchor=False, _greedy_draft=False,
        noise=DraftNoise(key=1, offset=torch.zeros(1, dtype=torch.int64)),
        draft_block_ids_view=lambda bs, device: ids,
    )  # fmt: skip
    info = SimpleNamespace(is_all_greedy=False, temperatures=torch.ones(bs, 1),
                           top_ks=torch.zeros(bs, dtype=torch.int32))  # fmt: skip
    proposal = plain_rounds.plain_proposal(
        proposer, draft_input=SimpleNamespace(bonus_tokens=torch.tensor([4, 7])), bs=bs,
        device="cpu", sampling_info=info, anchor_prepared=False,
    )  # fmt: skip
    assert ids[:, 0].tolist() == [4, 7] and proposer._dspark_plain_done
    assert proposal.confidence.eq(0).all() and proposal.draft_block.draft_tokens.eq(0).all()
    q = torch.softmax(proposal.draft_block.corrected_logits.float(), -1)
    assert q[..., 0].eq(1).all()
    assert int(proposer.noise.offset) == 1


def test_a_trace_records_each_measured_round_and_sums_it_up(tmp_path):
    clock = Clock()
    path = tmp_path / "trace.txt"
    policy = PlainRoundPolicy("auto", clock, trace=path)
    run(policy, clock, 4, 60, costs(0.10, 0.08, 2.0, 4))  # drafting pays: 80 vs 50 tok/s
    lines = [ln.split() for ln in path.read_text().splitlines()]
    assert len(lines) == 59  # every round but the last (its end is the next round's start)
    assert {(ln[1], ln[3]) for ln in lines} == {("0", "8"), ("1", "4")}
    assert any(ln[2] == "1" for ln in lines) and any(ln[2] == "0" for ln in lines)
    table = plain_rounds.trace_table(path)
    assert "| 4 | drafted | " in table and "| 100.0 | 80.0 |" in table
    assert "| 4 | plain | " in table and "| 80.0 | 50.0 |" in table


def test_nearby_large_batches_share_a_comparison_per_request():
    """Above 4 requests a bucket spans a power of two (9-16): a batch that moves between 14 and
    16 as requests end and start learns once, from tokens per request."""
    assert [plain_rounds.bucket(b) for b in (1, 3, 4, 5, 8, 9, 14, 16, 17)] == [
        1, 3, 4, 8, 8, 16, 16, 16, 32,
    ]  # fmt: skip
    clock = Clock()
    policy = PlainRoundPolicy("auto", clock)
    for rounds in range(40):  # drafting pays: 1.8 tokens a request in 0.2 s against 1 in 0.15
        bs = 14 + rounds % 3
        run(policy, clock, bs, 15, costs(0.20, 0.15, 1.8, bs))
    assert set(policy.comparisons) == {16}
    c = policy.comparisons[16]
    assert c.sure() and math.exp(c.mean()) == pytest.approx((1.8 / 0.2) / (1 / 0.15), rel=0.05)
    assert policy.summary().startswith("bs 9-16: drafted / plain 1.")

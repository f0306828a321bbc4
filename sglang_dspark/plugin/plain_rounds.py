"""`cpu_plain_rounds`: a DSPARK batch decodes plainly while drafting does not pay.

A DSpark round drafts (the backbone over the block, the Markov steps, the LM head), verifies
and accepts; it pays when the tokens it commits per second beat a plain decode's. At low
acceptance (temperature 1, prompts far from the drafter's data) it does not: the embedded CPU
server ran at 0.91x plain at one user, T=1. vLLM's dynamic speculative decoding turns
speculation off from a fixed batch-size threshold or a per-batch policy; ours measures both
sides on this engine, per batch size (`bucket`):

- a round's rate is the tokens it committed over the time to the next round's start (so it
  includes the scheduler's own per-round work);
- a *plain* round skips the draft pass entirely: no backbone, no Markov step, no LM head. The
  verify runs the anchor alone (every request verifies 0 drafts), which is a plain decode
  step: the target's logits at the next position, the bonus token sampled from them by the
  same accept. Lossless by construction; the drafter's context KV is still written by the
  verify's commit (the draft forward never writes context the next round reads), so the
  next speculative round drafts from the full context.

Each bucket of batch sizes starts speculative and is compared with plain decoding in *paired*
probes (`Comparison`): a few rounds of the other mode between rounds of the running one, the
first round after each switch left out. The policy this replaces kept an EMA of each mode's rate and
probed the other mode one round in 16: at 4 users, T=1 on a 2-core CPU it decoded 42% of its
rounds plainly and ran at 1.05x plain where drafting every round ran at 1.19x. Its trace shows
why: the round time of both modes drifts together (lag-1 autocorrelation 0.7, still 0.27 at 32
rounds), a drafted round's tokens vary by 30%, and a one-round probe pays the switch (+8-13 ms),
so the EMA compared rates measured minutes apart. Applies where `cpu_draft_until_verifiable`
does (CPU, `sync`) and only with SGLang's verify floor at the anchor (`min_verify_len` 1).

`SGLANG_DSPARK_PLAIN_ROUNDS`: `auto` (default), `off` (always draft: the side-by-side arm),
`always` (never draft: tests and the overhead measurement). `SGLANG_DSPARK_PLAIN_ROUNDS_TRACE=
FILE` appends every measured round to FILE (batch size, plain, first round after a change of
mode, tokens, seconds); `python -m sglang_dspark.plugin.plain_rounds FILE` sums it up per mode.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

from sglang_dspark.plugin.registry import register_after, register_around

logger = logging.getLogger(__name__)

MODE_ENV = "SGLANG_DSPARK_PLAIN_ROUNDS"
TRACE_ENV = "SGLANG_DSPARK_PLAIN_ROUNDS_TRACE"
MODES = ("auto", "off", "always")
WORKER_INIT = "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2.__init__"
FORWARD_DECODE = (
    "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2._forward_decode"
)
POLICY_ATTR = "_dspark_plain_policy"  # the worker's policy, also on its proposer
PROBE_ROUNDS = 4  # a probe: the switch round (not measured), then 3 measured rounds
PROBE_EVERY = 16  # rounds of the chosen mode between two probes while the choice is unsure
PROBE_EVERY_SURE = 64  # ... and once it is sure
SURE_Z = 3.0  # sure: the mean log ratio is this many standard errors from 0
HISTORY = 6  # paired comparisons kept per bucket
OUTLIER = 0.25  # a round under this share of its mode's last rate spans a gap, not a round


def mode() -> str:
    raw = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if raw not in MODES:
        raise ValueError(
            f"{MODE_ENV}={raw!r}: expected one of {', '.join(MODES)} (auto: decode plainly "
            "while drafting does not pay, off: always draft, always: never draft)"
        )
    return raw


def bucket(bs: int) -> int:
    """Batch sizes compared apart: each up to 4, then powers of two (5-8, 9-16, ...): at 16
    users the batch moves between 13 and 16 as requests end and start, and a bucket per size
    left each too few rounds to compare."""
    return bs if bs <= 4 else 1 << (bs - 1).bit_length()


def bucket_label(b: int) -> str:
    return str(b) if b <= 4 else f"{b // 2 + 1}-{b}"


@dataclass
class Block:
    """Measured rounds of one mode, summed: their rate is tokens over seconds."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.rounds += 1

    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Comparison:
    """One bucket of batch sizes: paired comparisons of the two modes.

    The mode that runs (`plain`) is probed by the other for `PROBE_ROUNDS` rounds every
    `PROBE_EVERY` rounds; a probe's measured rounds are compared with the running mode's
    measured rounds just before and just after it, so a drift of the round time that both modes
    share (contexts growing, the batch's mix, the machine) cancels, and the first round after a
    change of mode (which pays for the other mode's shapes once) is never a sample. The log of
    drafted over plain tokens per second of the last `HISTORY` comparisons decides the mode;
    probes thin out to one in `PROBE_EVERY_SURE` rounds once their mean is `SURE_Z` standard
    errors from 0."""

    plain: bool = False  # the running mode
    phase: str = "run"  # run | probe | after
    since_probe: int = 0
    probe_left: int = 0
    before: deque = field(default_factory=lambda: deque(maxlen=PROBE_ROUNDS - 1))
    probe: Block = field(default_factory=Block)
    after: Block = field(default_factory=Block)
    log_ratios: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    last_rate: dict[bool, float] = field(default_factory=dict)  # the outlier guard's reference

    def choose(self) -> tuple[bool, str]:
        """This round's mode (plain?) and its role in the comparison."""
        if self.phase == "run":
            self.since_probe += 1
            due = PROBE_EVERY_SURE if self.sure() else PROBE_EVERY
            if not self.log_ratios:
                due = PROBE_ROUNDS  # the first comparison comes early
            if self.since_probe >= due and len(self.before) == self.before.maxlen:
                self.phase, self.probe_left, self.probe = "probe", PROBE_ROUNDS, Block()
        if self.phase == "probe":
            self.probe_left -= 1
            if self.probe_left == 0:
                self.phase, self.after = "after", Block()
            return not self.plain, "probe"
        return self.plain, self.phase

    def add(self, plain: bool, role: str, switched: bool, tokens: float, seconds: float) -> None:
        """A measured round of this bucket: tokens per request, seconds."""
        rate = tokens / seconds
        ref = self.last_rate.get(plain)
        if switched or (ref is not None and rate < OUTLIER * ref):
            return
        self.last_rate[plain] = rate
        if role == "probe" and plain != self.plain:
            self.probe.add(tokens, seconds)
        elif plain == self.plain and role == "after" and self.phase == "after":
            self.after.add(tokens, seconds)
            if self.after.rounds >= PROBE_ROUNDS - 1:
                self._compare()
        elif plain == self.plain:
            self.before.append((tokens, seconds))

    def _compare(self) -> None:
        mine = Block()
        for tokens, seconds in self.before:
            mine.add(tokens, seconds)
        mine.add(self.after.tokens, self.after.seconds)
        if self.probe.rounds:
            ratio = self.probe.rate() / mine.rate()  # other mode over the running one
            self.log_ratios.append(math.log(ratio) * (1 if self.plain else -1))
        self.plain = self.mean() < 0
        self.phase, self.since_probe = "run", 0
        self.before.clear()

    def mean(self) -> float:
        """The mean log of drafted over plain tokens per second (0 before any comparison)."""
        return sum(self.log_ratios) / len(self.log_ratios) if self.log_ratios else 0.0

    def sure(self) -> bool:
        n = len(self.log_ratios)
        if n < HISTORY:
            return False
        m = self.mean()
        sd = math.sqrt(sum((x - m) ** 2 for x in self.log_ratios) / (n - 1))
        return abs(m) > SURE_Z * sd / math.sqrt(n)


@dataclass
class _Round:
    start: float
    bs: int
    plain: bool = False
    role: str = "run"
    tokens: int | None = None
    switched: bool = False  # the first round after a change of mode


class PlainRoundPolicy:
    """Chooses, per decode round, whether the batch drafts; learns from the rounds it sees."""

    def __init__(self, policy_mode: str = "auto", clock=time.perf_counter, trace=None) -> None:
        self.mode = policy_mode
        self.clock = clock
        self.comparisons: dict[int, Comparison] = {}
        self._last: _Round | None = None
        self._last_mode: bool | None = None  # the mode of the last finished round
        self.rounds = {False: 0, True: 0}
        self.trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115

    def choose_plain(self, bs: int) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        plain, role = self.comparisons.setdefault(bucket(bs), Comparison()).choose()
        if self._last is not None:
            self._last.role = role
        return plain

    def round_started(self, bs: int) -> None:
        """A decode round of `bs` requests starts now: the previous round's rate is its
        tokens over the time since it started, when the batch is the same."""
        now = self.clock()
        last = self._last
        if last is not None and last.tokens is not None and last.bs == bs and now > last.start:
            seconds = now - last.start
            self.comparisons.setdefault(bucket(bs), Comparison()).add(
                last.plain, last.role, last.switched, last.tokens / bs, seconds
            )  # tokens per request: a bucket holds several batch sizes
            if self.trace is not None:
                self.trace.write(f"{bs} {int(last.plain)} {int(last.switched)} {last.tokens} "
                                 f"{seconds:.6f}\n")  # fmt: skip
        self._last = _Round(now, bs)

    def round_finished(self, plain: bool, tokens: int) -> None:
        if self._last is not None:
            self._last.plain = plain
            self._last.tokens = tokens
            self._last.switched = self._last_mode is not None and self._last_mode != plain
        self._last_mode = plain
        self.rounds[plain] += 1

    def round_abandoned(self) -> None:
        self._last = None

    def summary(self) -> str:
        parts = []
        for b, c in sorted(self.comparisons.items()):
            if c.log_ratios:
                parts.append(f"bs {bucket_label(b)}: drafted / plain {math.exp(c.mean()):.2f} "
                             f"({len(c.log_ratios)} comparisons)")  # fmt: skip
        return "; ".join(parts)


def policy_of(obj) -> PlainRoundPolicy | None:
    return getattr(obj, POLICY_ATTR, None)


def trace_table(path) -> str:
    """A trace (`TRACE_ENV`) summed up per batch size and mode, steady rounds apart from the
    first after a change of mode: rounds, ms per round, tokens per second (sum over sum)."""
    sums: dict[tuple[int, bool, bool], list[float]] = {}
    with open(path) as f:
        for line in f:
            bs, plain, switched, tokens, seconds = line.split()
            s = sums.setdefault((int(bs), plain == "1", switched == "1"), [0, 0.0, 0.0])
            s[0] += 1
            s[1] += float(tokens)
            s[2] += float(seconds)
    rows = ["| bs | mode | rounds | ms / round | tok/s |", "| --- | --- | --- | --- | --- |"]
    for (bs, plain, switched), (n, tokens, seconds) in sorted(sums.items()):
        kind = ("plain" if plain else "drafted") + (", after a switch" if switched else "")
        rows.append(f"| {bs} | {kind} | {n} | {1e3 * seconds / n:.1f} | {tokens / seconds:.1f} |")
    return "\n".join(rows)


def _attach(result, worker, *args, **kwargs):
    policy = PlainRoundPolicy(mode(), trace=os.environ.get(TRACE_ENV) or None)
    setattr(worker, POLICY_ATTR, policy)
    proposer = getattr(worker, "_proposer", None)
    if proposer is not None:
        setattr(proposer, POLICY_ATTR, policy)
    if policy.mode != "off":
        logger.info("%s=%s: DSPARK batches decode plainly when drafting does not pay "
                    "(CPU, sync scheduler)", MODE_ENV, policy.mode)  # fmt: skip


def _forward_decode(original, worker, batch, on_publish, grammar_barrier=None,
                    coordination_plan=None):  # fmt: skip
    policy = policy_of(worker)
    proposer = getattr(worker, "_proposer", None)
    if policy is None or proposer is None or batch.forward_mode.is_idle():
        return original(worker, batch, on_publish, grammar_barrier, coordination_plan)
    bs = len(batch.seq_lens)
    policy.round_started(bs)
    proposer._dspark_plain_wanted = policy.choose_plain(bs)
    proposer._dspark_plain_done = False
    try:
        result = original(worker, batch, on_publish, grammar_barrier, coordination_plan)
    except BaseException:
        policy.round_abandoned()
        raise
    finally:
        proposer._dspark_plain_wanted = False
    accept_lens = getattr(result, "accept_lens", None)
    if accept_lens is None:
        policy.round_abandoned()
    else:
        policy.round_finished(bool(proposer._dspark_plain_done), int(accept_lens[:bs].sum()))
    total = policy.rounds[False] + policy.rounds[True]
    if policy.mode == "auto" and total % 2000 == 0:
        logger.info("plain rounds: %d of %d; %s", policy.rounds[True], total, policy.summary())
    return result


def wanted(proposer) -> bool:
    """Whether this round's draft pass should be skipped (read by `cpu_draft`'s pass)."""
    return bool(getattr(proposer, "_dspark_plain_wanted", False))


def compact_verify(planner) -> bool:
    """Whether the step verifies only what the scheduler asks for (`compact`): only then is a
    round without drafts a plain decode step rather than a verify of filler tokens."""
    return planner is not None and bool(getattr(planner, "is_compact_mode", False))


def plain_proposal(proposer, *, draft_input, bs, device, sampling_info, anchor_prepared):
    """The draft pass of a plain round: the anchor only, no drafts (confidence 0 everywhere,
    so the sync scheduler verifies the anchor alone), nothing computed."""
    import torch
    from sglang.srt.speculative.dspark_components.dspark_draft import (
        DraftBlockResult,
        DraftProposal,
        resolve_draft_params,
    )

    gamma = proposer.gamma
    block_ids = proposer.draft_block_ids_view(bs=bs, device=device)
    if not anchor_prepared:
        block_ids[:, 0].copy_(draft_input.bonus_tokens.view(-1))
    params = resolve_draft_params(sampling_info=sampling_info, bs=bs, device=device)
    greedy = bool(proposer._greedy_draft)
    model = proposer.draft_model
    logits = None
    if not greedy:  # a view, no allocation
        # Not read when the verify stops at the anchor. Were a filler draft (token 0) ever
        # verified, its proposal is the point mass on it, which it was drawn from: the accept
        # stays exact (kept with probability p(0), else a draw from the residual).
        vocab = int(model.markov_head.vocab_size)
        row = torch.zeros((1, 1, vocab), device=device)
        row[..., 0] = 1e4
        logits = row.expand(bs, gamma, vocab)
        proposer.noise.offset.add_(1)  # one block drawn, as a drafted round counts
    confidence = torch.zeros((bs, gamma), dtype=torch.float32, device=device)
    raw_dtype = model.confidence_head.proj.weight.dtype
    confidence_raw = torch.full(
        (bs, gamma), torch.finfo(raw_dtype).min, dtype=raw_dtype, device=device
    )
    proposer._dspark_plain_done = True
    return DraftProposal(
        draft_block_ids=(
            block_ids if proposer.sample_from_anchor else block_ids[:, :gamma].contiguous()
        ),
        draft_block=DraftBlockResult(
            draft_tokens=torch.zeros((bs, gamma), dtype=torch.int64, device=device),
            corrected_logits=logits,
            greedy_mask=params.greedy_mask,
            temperatures=params.temperatures,
            greedy_draft=greedy,
        ),
        confidence=confidence,
        confidence_raw=confidence_raw,
    )


def install() -> None:
    mode()  # a bad value stops the server at start-up
    register_after(WORKER_INIT, _attach)
    register_around(FORWARD_DECODE, _forward_decode)


HOOKS = {"cpu_plain_rounds": install}


if __name__ == "__main__":
    import sys

    print(trace_table(sys.argv[1]))

"""`cpu_plain_rounds`: a DSPARK batch decodes plainly while drafting does not pay.

A DSpark round drafts (the backbone over the block, the Markov steps, the LM head), verifies
and accepts; it pays when the tokens it commits per second beat a plain decode's. At low
acceptance (temperature 1, prompts far from the drafter's data) it does not: the embedded CPU
server ran at 0.91x plain at one user, T=1. vLLM's dynamic speculative decoding turns
speculation off from a fixed batch-size threshold or a per-batch policy; ours measures both
sides on this engine, per batch size:

- a *speculative* round's rate is the tokens it committed over the time to the next round's
  start (so it includes the scheduler's own per-round work), averaged (EMA) per batch size;
- a *plain* round skips the draft pass entirely: no backbone, no Markov step, no LM head. The
  verify runs the anchor alone (every request verifies 0 drafts), which is a plain decode
  step: the target's logits at the next position, the bonus token sampled from them by the
  same accept. Lossless by construction; the drafter's context KV is still written by the
  verify's commit (the draft forward never writes context the next round reads), so the
  next speculative round drafts from the full context.

Each batch size starts speculative; once both modes have `MIN_SAMPLES` measured rounds the
faster one runs, and the other is probed one round in `PROBE_EVERY`, so a change of load or
of acceptance is noticed within a few dozen rounds (the probes cost at most 1/PROBE_EVERY of
the gap between the two). Applies where `cpu_draft_until_verifiable` does (CPU, `sync`) and
only with SGLang's verify floor at the anchor (`min_verify_len` 1).

`SGLANG_DSPARK_PLAIN_ROUNDS`: `auto` (default), `off` (always draft: the side-by-side arm),
`always` (never draft: tests and the overhead measurement). `SGLANG_DSPARK_PLAIN_ROUNDS_TRACE=
FILE` appends every measured round to FILE (batch size, plain, first round after a change of
mode, tokens, seconds); `python -m sglang_dspark.plugin.plain_rounds FILE` sums it up per mode.
"""

from __future__ import annotations

import logging
import os
import time
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
MIN_SAMPLES = 3
PROBE_EVERY = 16
ALPHA = 0.25


def mode() -> str:
    raw = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if raw not in MODES:
        raise ValueError(
            f"{MODE_ENV}={raw!r}: expected one of {', '.join(MODES)} (auto: decode plainly "
            "while drafting does not pay, off: always draft, always: never draft)"
        )
    return raw


def bucket(bs: int) -> int:
    """Batch sizes measured apart: each up to 16, then powers of two."""
    return bs if bs <= 16 else 1 << (bs - 1).bit_length()


@dataclass
class Rates:
    """Per batch size: EMAs of tokens per second of each mode and their sample counts."""

    rate: dict[bool, float] = field(default_factory=dict)  # plain? -> tokens/s
    count: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    since_probe: int = 0

    def add(self, plain: bool, value: float) -> None:
        old = self.rate.get(plain)
        if old is not None and value < 0.25 * old:
            return  # a prefill or an idle gap between the two rounds, not this round's cost
        self.rate[plain] = value if old is None else (1 - ALPHA) * old + ALPHA * value
        self.count[plain] += 1


@dataclass
class _Round:
    start: float
    bs: int
    plain: bool
    tokens: int | None = None


class PlainRoundPolicy:
    """Chooses, per decode round, whether the batch drafts; learns from the rounds it sees."""

    def __init__(self, policy_mode: str = "auto", clock=time.perf_counter, trace=None) -> None:
        self.mode = policy_mode
        self.clock = clock
        self.rates: dict[int, Rates] = {}
        self._last: _Round | None = None
        self._modes: list[bool] = []  # the last two finished rounds' modes
        self.rounds = {False: 0, True: 0}
        self.trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115

    def choose_plain(self, bs: int) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        r = self.rates.setdefault(bucket(bs), Rates())
        if r.count[False] < MIN_SAMPLES:
            return False
        if r.count[True] < MIN_SAMPLES:
            return True
        best = r.rate[True] > r.rate[False]
        r.since_probe += 1
        if r.since_probe >= PROBE_EVERY:
            r.since_probe = 0
            return not best
        return best

    def round_started(self, bs: int) -> None:
        """A decode round of `bs` requests starts now: the previous round's rate is its
        tokens over the time since it started, when the batch is the same."""
        now = self.clock()
        last = self._last
        if last is not None and last.tokens is not None and last.bs == bs and now > last.start:
            self.rates.setdefault(bucket(bs), Rates()).add(
                last.plain, last.tokens / (now - last.start)
            )
            if self.trace is not None:
                switched = len(self._modes) == 2 and self._modes[0] != self._modes[1]
                self.trace.write(f"{bs} {int(last.plain)} {int(switched)} {last.tokens} "
                                 f"{now - last.start:.6f}\n")  # fmt: skip
        self._last = _Round(now, bs, plain=False)

    def round_finished(self, plain: bool, tokens: int) -> None:
        if self._last is not None:
            self._last.plain = plain
            self._last.tokens = tokens
        self._modes = [*self._modes[-1:], plain]
        self.rounds[plain] += 1

    def round_abandoned(self) -> None:
        self._last = None

    def summary(self) -> str:
        parts = []
        for b, r in sorted(self.rates.items()):
            spec, plain = r.rate.get(False), r.rate.get(True)
            if spec is not None and plain is not None:
                parts.append(f"bs {b}: draft {spec:.1f} / plain {plain:.1f} tok/s")
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

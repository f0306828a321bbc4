"""Load-test measurements: per-request samples, stage windows and the per-stage summary.

Pure standard library, no Locust and no gevent: `loadtest/sla.py` (the Locust glue) records
samples with it, `sglang_dspark.measurement.pareto` reads the summaries it writes, and the tests exercise
it on synthetic streams. The file is also usable on its own next to `sla.py` (no imports from
the rest of the package).

One clock for everything: seconds of `time.perf_counter()` minus the run's start, so 0 is the
start of the run.

Per request (a `Sample`):

- start: the request was sent; end: the stream ended (``[DONE]`` or the connection closed);
- first_token: arrival of the first chunk carrying generated text (``delta.content`` or
  ``delta.reasoning_content``);
- output tokens: the server's ``usage.completion_tokens`` (``stream_options.include_usage``),
  never a count of chunks: a chunk may carry several tokens (speculative decoding commits
  several per step). A request without usage has ``output_tokens=None`` ("tokens unknown"):
  it is counted in ``missing_usage`` and left out of every token-based number;
- TTFT = first_token - start; e2e = end - start;
- TPOT (time per output token after the first) = (e2e - TTFT) / (output_tokens - 1);
- tok/s per user = 1 / TPOT = (output_tokens - 1) / (end - first_token), the speed once the
  answer streams; with TTFT (the SLA view, what a user waits for): output_tokens / e2e;
- token timeline: with ``stream_options.continuous_usage_stats`` each chunk carries the
  cumulative ``completion_tokens``, so the tokens of every chunk and their arrival time are
  known exactly; ITL (inter-token latency) = the gap between two chunks divided by the tokens
  of the later one, once per token. Without it ITL is not reported and tokens are assumed to
  arrive uniformly between the first token and the end (the first token at first_token);
- accept length / verify length: SGLang's per-request ``sglext.spec_tokens_details``
  (``return_spec_tokens_details``): ``spec_accept_length`` (completion tokens per verify
  step) and ``spec_cap_length`` (mean verify window per step, anchor included: MTP-1 is 2).

Per stage (a `StageWindow`): the shape holds the stage's users for ``stage_seconds`` from
run_start to run_end, then drains: users send nothing new, in-flight requests finish, and only
then does the next stage start. The steady-state window is [run_start + warmup, run_end):

- output_tok_s_total: tokens generated inside the window (from every request, wherever it
  started: each request's timeline is clipped to the window) / window length. Exact with
  timelines; under the uniform assumption otherwise. In-flight requests at the window's end
  count for the part they generated inside it;
- output_tok_s_same: the same aggregate from the requests that *started* inside the window
  (the ones the per-user speeds describe, so x and y of a Pareto point come from one set):
  users x sum(output_tokens) / sum(e2e), Little's law for a closed loop without think time
  (each user always has one request in flight: a user's rate is its tokens over its time);
- requests_per_s: successful requests that *completed* inside the window / window length;
- latency and speed distributions (TTFT, TPOT, ITL, e2e, tok/s per user) and failures: the
  requests that *started* inside the window. Thanks to the drain every one of them completes,
  so the distributions are not biased towards short requests;
- goodput: requests completed inside the window that met every configured SLO (TTFT <=
  slo_ttft_s, TPOT <= slo_tpot_s; a failed request or unknown TPOT never meets one) / window
  length; slo_attainment: the fraction of the requests started inside the window that met
  them; slo_met: slo_attainment >= the required attainment (None without SLOs);
- quantiles: linear interpolation between order statistics (numpy's default), None when
  there is no value.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import pairwise
from pathlib import Path
from typing import Any

SCHEMA = "sglang-dspark/sla-summary/v1"

DEFAULT_PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Show your steps.",
    "List five practical tips for writing readable code.",
    "Summarize the difference between a process and a thread.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
)
EVAL_FILES = ("gsm8k.jsonl", "humaneval.jsonl", "mt-bench.jsonl")

# Server fields kept in the summary (SGLang's /server_info; absent ones are None).
SERVER_FIELDS = (
    "model_path",
    "served_model_name",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_draft_tokens",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_dspark_block_size",
    "speculative_dspark_confidence_sts_path",
    "speculative_dspark_sps_table_path",
    "tp_size",
    "dp_size",
    "max_running_requests",
    "version",
)
# Per-rank live state kept from /server_info's internal_states (the rest can be large).
INTERNAL_STATE_FIELDS = (
    "avg_spec_accept_length",
    "last_gen_throughput",
    "effective_max_running_requests_per_dp",
)


# ------------------------------------------------------------------------------------------
# numbers


def quantile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1), linear between order statistics; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals else None


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Length of the intersection of the intervals [a0, a1] and [b0, b1] (0 when disjoint)."""
    return max(0.0, min(a1, b1) - max(a0, b0))


# ------------------------------------------------------------------------------------------
# one request


@dataclass
class Sample:
    """One streamed request, times in seconds since the start of the run (see the module)."""

    stage: int
    start: float
    end: float
    ok: bool
    first_token: float | None = None
    output_tokens: int | None = None  # usage.completion_tokens; None: tokens unknown
    content_chunks: int = 0
    # (arrival time, tokens in the chunk), from continuous usage stats; None: not reported
    timeline: list[tuple[float, int]] | None = None
    error: str = ""
    accept_len: float | None = None  # sglext spec_accept_length
    verify_len: float | None = None  # sglext spec_cap_length
    verify_steps: int | None = None  # sglext spec_verify_ct

    @property
    def tokens_known(self) -> bool:
        return self.output_tokens is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (tokens - 1); None with fewer than 2 tokens or unknown tokens."""
        if not self.ok or self.first_token is None or not self.output_tokens:
            return None
        if self.output_tokens < 2 or self.end <= self.first_token:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def user_tok_s(self) -> float | None:
        tpot = self.tpot
        return None if tpot is None else 1.0 / tpot

    @property
    def user_tok_s_e2e(self) -> float | None:
        """output_tokens / e2e: the per-user speed with the time to first token in it."""
        if not self.ok or not self.output_tokens or self.end <= self.start:
            return None
        return self.output_tokens / (self.end - self.start)

    def itl(self) -> list[float]:
        """Inter-token latencies from the timeline: each chunk's gap / its tokens, per token."""
        if not self.timeline or len(self.timeline) < 2:
            return []
        out: list[float] = []
        for (t_prev, _), (t, n) in pairwise(self.timeline):
            if n > 0:
                out.extend([(t - t_prev) / n] * n)
        return out

    def tokens_in(self, a: float, b: float) -> float:
        """Output tokens generated in [a, b): exact from the timeline, else uniform between
        the first token (one token at first_token) and the end; 0 for a failed or unknown one."""
        if not self.ok or self.output_tokens is None or self.first_token is None:
            return 0.0
        if self.timeline:
            return float(sum(n for t, n in self.timeline if a <= t < b))
        n, t0, t1 = self.output_tokens, self.first_token, self.end
        inside = 1.0 if a <= t0 < b else 0.0
        if n > 1:
            if t1 > t0:
                inside += (n - 1) * overlap(t0, t1, a, b) / (t1 - t0)
            elif a <= t0 < b:
                inside += n - 1
        return inside

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("start", "end", "first_token"):
            if d[key] is not None:
                d[key] = round(d[key], 6)
        if self.timeline is not None:
            d["timeline"] = [[round(t, 6), n] for t, n in self.timeline]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Sample:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if kw.get("timeline") is not None:
            kw["timeline"] = [(float(t), int(n)) for t, n in kw["timeline"]]
        return cls(**kw)


class StreamParser:
    """Builds a `Sample` from the bytes of an OpenAI-style SSE chat stream, as they arrive.

    `feed(data, now)` for each piece read from the socket, `finish(now)` at the end. Usage comes
    from the server (``usage.completion_tokens``); chunks are only counted for information.
    """

    def __init__(self, stage: int, start: float):
        self.stage = stage
        self.start = start
        self.first_token: float | None = None
        self.content_chunks = 0
        self.completion_tokens: int | None = None
        self.timeline: list[tuple[float, int]] = []
        self.continuous = False  # usage arrived with content chunks, not only at the end
        self.error = ""
        self.spec: dict[str, Any] | None = None
        self._buffer = b""

    def feed(self, data: bytes, now: float) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._line(line.strip(), now)

    def _line(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return  # blank separators, "event:" and ":" comment lines
        body = line[5:].strip()
        if not body or body == b"[DONE]":
            return
        try:
            event = json.loads(body)
        except ValueError:
            self.error = self.error or f"unparsable stream line: {body[:120]!r}"
            return
        if not isinstance(event, dict):
            return
        if event.get("error"):
            err = event["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return
        content = False
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                content = True
        if content:
            self.content_chunks += 1
            if self.first_token is None:
                self.first_token = now
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            total = int(usage["completion_tokens"])
            seen = sum(n for _, n in self.timeline)
            if content:
                self.continuous = True
            if total > seen:
                self.timeline.append((now, total - seen))
            self.completion_tokens = total
        ext = event.get("sglext")
        if isinstance(ext, dict) and ext.get("spec_tokens_details"):
            details = ext["spec_tokens_details"]
            self.spec = details[0] if isinstance(details, list) else details

    def finish(self, now: float, error: str = "") -> Sample:
        """The sample; `error` (e.g. a broken connection) marks it failed."""
        if self._buffer.strip():
            self._line(self._buffer.strip(), now)
            self._buffer = b""
        error = error or self.error
        if not error and self.first_token is None:
            error = "stream ended without any generated text"
        spec = self.spec or {}
        return Sample(
            stage=self.stage,
            start=self.start,
            end=now,
            ok=not error,
            first_token=self.first_token,
            output_tokens=self.completion_tokens,
            content_chunks=self.content_chunks,
            timeline=list(self.timeline) if self.continuous and self.timeline else None,
            error=error,
            accept_len=spec.get("spec_accept_length") or None,
            verify_len=spec.get("spec_cap_length") or None,
            verify_steps=spec.get("spec_verify_ct") or None,
        )


# ------------------------------------------------------------------------------------------
# stages


@dataclass
class StageWindow:
    """One concurrency level: users held from run_start to run_end, then the drain."""

    index: int
    users: int
    run_start: float
    run_end: float
    warmup_s: float
    drain_end: float | None = None  # the shape's tick that ended the drain (1 s ticks)
    drain_incomplete: int = 0  # requests still in flight when the drain timed out
    last_done: float | None = None  # when the stage's last request finished

    @property
    def window_start(self) -> float:
        return self.run_start + self.warmup_s

    @property
    def window_end(self) -> float:
        return self.run_end

    @property
    def window_s(self) -> float:
        return max(0.0, self.window_end - self.window_start)


class SweepClock:
    """The stage state machine behind the Locust shape (pure: times are passed in).

    `tick(now)` (the shape, about once a second) returns the user count to hold, or None when
    the sweep is over, and the stage event that happened, if any: ("end", i) when stage i's
    drain is over, then ("start", i + 1) at the following tick (call it again at once).
    `acquire(now)` is asked by a user before each request: the stage to attribute it to, or
    None while draining / between stages / when the stage already has its users in flight.
    `release(stage)` when the request is over.
    """

    def __init__(
        self,
        users: Sequence[int],
        stage_seconds: float,
        warmup_s: float,
        drain_timeout_s: float,
    ):
        self.users = tuple(users)
        self.stage_seconds = stage_seconds
        self.warmup_s = warmup_s
        self.drain_timeout_s = drain_timeout_s
        self.stages: list[StageWindow] = []
        self.in_flight: dict[int, int] = {}
        self.done = False

    @property
    def current(self) -> StageWindow | None:
        return self.stages[-1] if self.stages else None

    def _start(self, index: int, now: float) -> None:
        self.stages.append(
            StageWindow(index, self.users[index], now, now + self.stage_seconds, self.warmup_s)
        )

    def tick(self, now: float) -> tuple[int | None, list[tuple[str, int]]]:
        if self.done:
            return None, []
        cur = self.current
        if cur is None or cur.drain_end is not None:  # the first stage, or the next one
            index = 0 if cur is None else cur.index + 1
            self._start(index, now)
            return self.users[index], [("start", index)]
        if now >= cur.run_end:
            busy = self.in_flight.get(cur.index, 0)
            if busy == 0 or now >= cur.run_end + self.drain_timeout_s:
                cur.drain_end = now
                cur.drain_incomplete = busy
                self.done = cur.index + 1 >= len(self.users)
                # The next stage starts at the next tick: the caller snapshots in between.
                return (None if self.done else cur.users), [("end", cur.index)]
        return cur.users, []

    def acquire(self, now: float) -> int | None:
        cur = self.current
        if self.done or cur is None or cur.drain_end is not None or now >= cur.run_end:
            return None
        if self.in_flight.get(cur.index, 0) >= cur.users:
            return None
        self.in_flight[cur.index] = self.in_flight.get(cur.index, 0) + 1
        return cur.index

    def release(self, stage: int, now: float | None = None) -> None:
        self.in_flight[stage] = max(0, self.in_flight.get(stage, 0) - 1)
        if now is not None and stage < len(self.stages):
            self.stages[stage].last_done = now

    def stop(self, now: float) -> None:
        """An interrupted run: close the current stage where it is."""
        cur = self.current
        if cur is not None and cur.drain_end is None:
            cur.run_end = min(cur.run_end, now)
            cur.drain_end = now
            cur.drain_incomplete = self.in_flight.get(cur.index, 0)
        self.done = True


# ------------------------------------------------------------------------------------------
# SLOs and the per-stage summary


@dataclass(frozen=True)
class Slo:
    """Service-level objectives per request; None: not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    attainment: float = 0.9  # the fraction of requests that must meet them

    @property
    def enabled(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def meets(self, s: Sample) -> bool:
        if not s.ok:
            return False
        if self.ttft_s is not None and (s.ttft is None or s.ttft > self.ttft_s):
            return False
        if self.tpot_s is not None:
            tpot = s.tpot
            if tpot is None and s.output_tokens == 1:
                tpot = 0.0  # a single token has no time per further token
            if tpot is None or tpot > self.tpot_s:
                return False
        return True


@dataclass
class StageSummary:
    """One row of the report (definitions in the module docstring); None: nothing to measure."""

    stage: int
    users: int
    window_start_s: float
    window_end_s: float
    window_s: float
    requests: int  # started inside the window
    failures: int
    missing_usage: int  # succeeded without usage.completion_tokens: tokens unknown
    completed_in_window: int
    output_tokens: int  # of the requests started inside the window, known ones
    output_tok_s_total: float  # aggregate: tokens generated inside the window / window
    requests_per_s: float
    goodput_rps: float
    slo_attainment: float | None
    slo_met: bool | None
    user_tok_s_mean: float | None
    user_tok_s_p10: float | None
    user_tok_s_p50: float | None
    user_tok_s_p90: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    accept_len: float | None  # completion tokens / verify steps, from per-request sglext
    verify_len_mean: float | None  # mean over requests of their mean verify window
    # /server_info avg_spec_accept_length at the stage's end: cumulative since the server
    # started, and SGLang refreshes it only at its decode-log interval, so it lags; accept_len
    # (per request, exact) is the stage's own number.
    server_accept_len: float | None = None
    client_cpu_share: float | None = None  # locust process CPU seconds / wall seconds
    user_tok_s_e2e_mean: float | None = None  # mean over requests of tokens / e2e (with TTFT)
    user_tok_s_e2e_p50: float | None = None
    output_tok_s_same: float | None = None  # users x sum(tokens) / sum(e2e), started set
    drain_s: float | None = None
    drain_incomplete: int = 0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def summarize_stage(samples: Iterable[Sample], window: StageWindow, slo: Slo) -> StageSummary:
    """The stage's row from all the run's samples (see the module docstring)."""
    samples = list(samples)
    a, b = window.window_start, window.window_end
    width = window.window_s
    started = [s for s in samples if a <= s.start < b]
    ok = [s for s in started if s.ok]
    measured = [s for s in ok if s.tokens_known]
    completed = [s for s in samples if s.ok and a <= s.end < b]
    tokens = sum(s.tokens_in(a, b) for s in samples)
    speeds = [v for s in measured if (v := s.user_tok_s) is not None]
    speeds_e2e = [v for s in measured if (v := s.user_tok_s_e2e) is not None]
    timed = [s for s in measured if s.e2e > 0]
    busy = sum(s.e2e for s in timed)
    ttfts = [v for s in ok if (v := s.ttft) is not None]
    tpots = [v for s in measured if (v := s.tpot) is not None]
    itls = [v for s in measured for v in s.itl()]
    e2es = [s.e2e for s in ok]
    verify_steps = sum(s.verify_steps for s in measured if s.verify_steps)
    verify_tokens = sum(s.output_tokens for s in measured if s.verify_steps)
    verify_lens = [s.verify_len for s in measured if s.verify_len]
    attainment = sum(slo.meets(s) for s in started) / len(started) if started else None
    good = sum(slo.meets(s) for s in completed)
    notes = []
    if not started:
        notes.append("no request started inside the window")
    if not completed:
        notes.append("no request completed inside the window")
    if width <= 0:
        notes.append("empty window (warm-up >= stage)")

    def per_s(x: float) -> float:
        return x / width if width > 0 else 0.0

    # The drain: from the end of the hold to the stage's last answer (or the tick that gave up).
    drain_to = window.last_done if not window.drain_incomplete else window.drain_end
    drain = None if drain_to is None else max(0.0, drain_to - window.run_end)
    return StageSummary(
        stage=window.index,
        users=window.users,
        window_start_s=a,
        window_end_s=b,
        window_s=width,
        requests=len(started),
        failures=len(started) - len(ok),
        missing_usage=len(ok) - len(measured),
        completed_in_window=len(completed),
        output_tokens=sum(s.output_tokens for s in measured),
        output_tok_s_total=per_s(tokens),
        requests_per_s=per_s(len(completed)),
        goodput_rps=per_s(good),
        slo_attainment=attainment if slo.enabled else None,
        slo_met=(attainment is not None and attainment >= slo.attainment) if slo.enabled else None,
        user_tok_s_mean=mean(speeds),
        user_tok_s_p10=quantile(speeds, 0.10),
        user_tok_s_p50=quantile(speeds, 0.50),
        user_tok_s_p90=quantile(speeds, 0.90),
        ttft_p50_s=quantile(ttfts, 0.50),
        ttft_p90_s=quantile(ttfts, 0.90),
        ttft_p99_s=quantile(ttfts, 0.99),
        tpot_p50_s=quantile(tpots, 0.50),
        tpot_p90_s=quantile(tpots, 0.90),
        tpot_p99_s=quantile(tpots, 0.99),
        itl_p50_s=quantile(itls, 0.50),
        itl_p90_s=quantile(itls, 0.90),
        itl_p99_s=quantile(itls, 0.99),
        e2e_p50_s=quantile(e2es, 0.50),
        e2e_p90_s=quantile(e2es, 0.90),
        e2e_p99_s=quantile(e2es, 0.99),
        accept_len=verify_tokens / verify_steps if verify_steps else None,
        verify_len_mean=mean(verify_lens),
        drain_s=drain,
        drain_incomplete=window.drain_incomplete,
        note="; ".join(notes),
        user_tok_s_e2e_mean=mean(speeds_e2e),
        user_tok_s_e2e_p50=quantile(speeds_e2e, 0.50),
        output_tok_s_same=(
            window.users * sum(s.output_tokens for s in timed) / busy if busy > 0 else None
        ),
    )


def run_problems(rows: Sequence[StageSummary], slo: Slo) -> list[str]:
    """Why the run must exit non-zero: stages without a measured request, failures, unknown
    token counts, SLO breaches, drains that timed out. Empty: a clean run."""
    problems = []
    for r in rows:
        where = f"stage {r.stage} ({r.users} users)"
        if not r.requests:
            problems.append(
                f"{where}: no request started inside the window [{r.window_start_s:.1f}, "
                f"{r.window_end_s:.1f}) s, so nothing was measured: lengthen SLA_STAGE_SECONDS "
                "or shorten SLA_WARMUP_SECONDS"
            )
        if r.failures:
            problems.append(f"{where}: {r.failures} of {r.requests} requests failed")
        if r.missing_usage:
            problems.append(
                f"{where}: {r.missing_usage} responses had no usage.completion_tokens, so their "
                "tokens are unknown (the server must honour stream_options.include_usage)"
            )
        if r.drain_incomplete:
            problems.append(
                f"{where}: {r.drain_incomplete} requests were still running when the drain timed "
                "out (raise SLA_DRAIN_TIMEOUT_S or SLA_REQUEST_TIMEOUT_S)"
            )
        if r.slo_met is False:
            att = "no requests" if r.slo_attainment is None else f"{r.slo_attainment:.1%}"
            limits = [
                f"{name}<={v} s"
                for name, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s))
                if v is not None
            ]
            problems.append(
                f"{where}: SLO breached: {att} of requests met {' and '.join(limits)} "
                f"(SLA_SLO_ATTAINMENT={slo.attainment:g})"
            )
    return problems


# ------------------------------------------------------------------------------------------
# configuration (environment variables, documented in loadtest/sla.py)


def _env_number(
    env: Mapping[str, str],
    name: str,
    default: Any,
    kind: type = float,
    *,
    minimum: float | None = None,
    strict: bool = False,
) -> Any:
    """The variable as `kind`; `default` when unset or empty; checked against `minimum`."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {raw!r}")
    return value


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false), got {raw!r}")


def default_warmup(stage_seconds: float) -> float:
    """10% of the stage, at least 2 s, but never more than a quarter of it."""
    return min(max(2.0, 0.1 * stage_seconds), 0.25 * stage_seconds)


@dataclass(frozen=True)
class SlaConfig:
    users: tuple[int, ...]
    stage_seconds: float
    warmup_seconds: float
    drain_timeout_seconds: float
    request_timeout_seconds: float
    max_tokens: int
    temperature: float
    ignore_eos: bool
    input_tokens: int | None
    model: str
    label: str
    prompts: tuple[str, ...]
    prompts_source: str
    output_dir: Path
    extra_body: dict
    spec_details: bool
    slo: Slo = field(default_factory=Slo)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, eval_dirs: Sequence[Path] = ()
    ) -> SlaConfig:
        """Read the SLA_* variables; `eval_dirs`: where to look for the default prompts."""
        env = os.environ if env is None else env
        raw_users = env.get("SLA_USERS", "1,4,16")
        try:
            users = tuple(int(u) for u in raw_users.split(",") if u.strip())
        except ValueError:
            users = ()
        if not users or min(users) < 1:
            raise ValueError(
                f"SLA_USERS must list positive integers like '1,4,16', got {raw_users!r}"
            )
        stage = _env_number(env, "SLA_STAGE_SECONDS", 60.0, minimum=0, strict=True)
        warmup = _env_number(env, "SLA_WARMUP_SECONDS", default_warmup(stage), minimum=0)
        if warmup >= stage:
            raise ValueError(
                f"SLA_WARMUP_SECONDS ({warmup}) must be shorter than SLA_STAGE_SECONDS ({stage})"
            )
        try:
            extra = json.loads(env.get("SLA_EXTRA_BODY") or "{}")
        except ValueError as exc:
            raise ValueError(f"SLA_EXTRA_BODY must be a JSON object: {exc}") from None
        if not isinstance(extra, dict):
            raise TypeError(f"SLA_EXTRA_BODY must be a JSON object, got {type(extra).__name__}")
        input_tokens = _env_number(env, "SLA_INPUT_TOKENS", None, int, minimum=1)
        if env.get("SLA_PROMPTS_FILE"):
            source = env["SLA_PROMPTS_FILE"]
            prompts = load_prompts_file(source)
        else:
            prompts, source = default_prompts(eval_dirs)
        if input_tokens:
            prompts = tuple(fit_prompt(p, input_tokens) for p in prompts)
        slo = Slo(
            ttft_s=_env_number(env, "SLA_SLO_TTFT_S", None, minimum=0, strict=True),
            tpot_s=_env_number(env, "SLA_SLO_TPOT_S", None, minimum=0, strict=True),
            attainment=_env_number(env, "SLA_SLO_ATTAINMENT", 0.9, minimum=0),
        )
        if slo.attainment > 1:
            raise ValueError(f"SLA_SLO_ATTAINMENT must be in [0, 1], got {slo.attainment}")
        return cls(
            users=users,
            stage_seconds=stage,
            warmup_seconds=warmup,
            drain_timeout_seconds=_env_number(env, "SLA_DRAIN_TIMEOUT_S", 600.0, minimum=0),
            request_timeout_seconds=_env_number(
                env, "SLA_REQUEST_TIMEOUT_S", 600.0, minimum=0, strict=True
            ),
            max_tokens=_env_number(env, "SLA_MAX_TOKENS", 256, int, minimum=1),
            temperature=_env_number(env, "SLA_TEMPERATURE", 0.0, minimum=0),
            ignore_eos=_env_flag(env, "SLA_IGNORE_EOS", False),
            input_tokens=input_tokens,
            model=env.get("SLA_MODEL", ""),
            label=env.get("SLA_LABEL", ""),
            prompts=prompts,
            prompts_source=source,
            output_dir=Path(env.get("SLA_OUTPUT_DIR") or "."),
            extra_body=extra,
            spec_details=_env_flag(env, "SLA_SPEC_DETAILS", True),
            slo=slo,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("prompts")
        d["prompts_count"] = len(self.prompts)
        d["output_dir"] = str(self.output_dir)
        return d

    def request_body(self, model: str, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.spec_details:
            body["return_spec_tokens_details"] = True
        return {**body, **self.extra_body}


# ------------------------------------------------------------------------------------------
# prompts


def _first_human(conversations: Any) -> str | None:
    for turn in conversations or []:
        if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
            return turn.get("value", turn.get("content"))
    return None


def _prompt_of(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    if record.get("turns"):
        return record["turns"][0]
    if "conversations" in record:
        return _first_human(record["conversations"])
    return None


def load_prompts_file(path: str | Path) -> tuple[str, ...]:
    """Prompts from our JSON lines (``{"turns": [...]}``, the first turn) or a ShareGPT JSON
    file (a list of ``{"conversations": [{"from": "human", "value": ...}, ...]}``, the first
    human turn), told apart by the content."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"SLA_PROMPTS_FILE {path} cannot be read: {exc}") from None
    records: list[Any]
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError as exc:
            raise ValueError(
                f"SLA_PROMPTS_FILE {path} looks like JSON (ShareGPT) but does not parse: {exc}"
            ) from None
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"SLA_PROMPTS_FILE {path}:{lineno} is not JSON: {exc}") from None
    prompts = tuple(p for r in records if (p := _prompt_of(r)))
    if not prompts:
        raise ValueError(
            f"SLA_PROMPTS_FILE {path} holds no prompts: expected JSON lines of "
            '{"turns": ["..."]} or a ShareGPT list of {"conversations": [{"from": "human", '
            '"value": "..."}]}'
        )
    return prompts


def default_prompts(eval_dirs: Sequence[Path]) -> tuple[tuple[str, ...], str]:
    """The packaged eval prompts (gsm8k, humaneval, mt-bench) interleaved one from each file
    in turn, from the first directory holding any of them; else the built-in DEFAULT_PROMPTS."""
    for d in eval_dirs:
        files = [Path(d) / name for name in EVAL_FILES if (Path(d) / name).is_file()]
        if not files:
            continue
        lists = [load_prompts_file(f) for f in files]
        mixed = [
            p for i in range(max(map(len, lists))) for ps in lists if i < len(ps) for p in [ps[i]]
        ]
        return tuple(mixed), ",".join(str(f) for f in files)
    return DEFAULT_PROMPTS, "built-in"


def fit_prompt(text: str, words: int) -> str:
    """SLA_INPUT_TOKENS, approximated by whitespace-separated words: longer prompts are cut to
    `words` words, shorter ones repeated (blank line between) and then cut to `words`."""
    have = len(text.split())
    if have == 0:
        return text
    if have < words:
        text = "\n\n".join([text] * -(-words // have))
    return _cut_words(text, words)


def _cut_words(text: str, words: int) -> str:
    """The text up to its `words`-th word, whitespace (newlines) kept."""
    count, i, n = 0, 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        count += 1
        while i < n and not text[i].isspace():
            i += 1
        if count == words:
            return text[:i]
    return text


# ------------------------------------------------------------------------------------------
# what was measured


def trim_server_info(info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """/server_info without its bulky live parts: internal_states keeps INTERNAL_STATE_FIELDS."""
    if info is None:
        return None
    out = dict(info)
    states = out.get("internal_states")
    if isinstance(states, list):
        out["internal_states"] = [
            {k: s.get(k) for k in INTERNAL_STATE_FIELDS if k in s}
            for s in states
            if isinstance(s, dict)
        ]
    return out


def server_fields(info: Mapping[str, Any] | None) -> dict[str, Any]:
    info = info or {}
    return {k: info.get(k) for k in SERVER_FIELDS}


def server_accept_length(info: Mapping[str, Any] | None) -> float | None:
    """Mean over ranks of internal_states[*].avg_spec_accept_length: SGLang's cumulative
    accepted-tokens / verify-steps since the server started (not per stage)."""
    states = (info or {}).get("internal_states") or []
    vals = [
        s["avg_spec_accept_length"]
        for s in states
        if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None
    ]
    return mean(vals)


def arm_label(label: str, info: Mapping[str, Any] | None) -> str:
    """SLA_LABEL, else the algorithm (lower case) and its draft tokens, e.g. 'dspark-k8';
    'no-spec' without speculative decoding. SGLANG_DSPARK_SCHEDULER is not visible in
    /server_info: put it in SLA_LABEL (e.g. 'dspark-sync')."""
    if label:
        return label
    info = info or {}
    algo = info.get("speculative_algorithm")
    if not algo:
        return "no-spec" if info else "unknown"
    k = info.get("speculative_num_draft_tokens")
    return f"{str(algo).lower()}-k{k}" if k else str(algo).lower()


# ------------------------------------------------------------------------------------------
# the report


def build_report(
    config: SlaConfig,
    host: str,
    model: str,
    server_info: Mapping[str, Any] | None,
    rows: Sequence[StageSummary],
    stages: Sequence[StageWindow],
    stage_server_info: Mapping[int, Mapping[str, Any]],
    samples: Sequence[Sample],
    problems: Sequence[str],
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "label": arm_label(config.label, server_info),
        "host": host,
        "model": model,
        "server": server_fields(server_info),
        "server_info": trim_server_info(server_info),
        "config": config.to_dict(),
        "stages": [r.to_dict() for r in rows],
        "stage_windows": [asdict(w) for w in stages],
        "stage_server_info": {str(k): v for k, v in stage_server_info.items()},
        "problems": list(problems),
        "exit_code": 1 if problems else 0,
        "samples": [s.to_dict() for s in samples],
    }


def write_report(report: Mapping[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """sla_summary.json (everything) and sla_summary.csv (one row per stage)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "sla_summary.json"
    js.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    cs = out_dir / "sla_summary.csv"
    cs.write_text(stages_csv(report), encoding="utf-8")
    return js, cs


def stages_csv(report: Mapping[str, Any]) -> str:
    names = [f.name for f in fields(StageSummary)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["label", *names], extrasaction="ignore")
    writer.writeheader()
    for row in report["stages"]:
        writer.writerow({"label": report["label"], **row})
    return buf.getvalue()


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "sla_summary.json"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the load-test summary {path}: {exc}") from None
    if not isinstance(report, dict) or "stages" not in report:
        raise ValueError(
            f"{path} is not an sla_summary.json (no 'stages'); write one with "
            "`locust -f loadtest/sla.py --headless --host ...`"
        )
    return report


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec)


COLUMNS: tuple[tuple[str, str, str, Callable[[Any], Any] | None], ...] = (
    ("users", "users", "d", None),
    ("reqs", "requests", "d", None),
    ("fail", "failures", "d", None),
    ("req/s", "requests_per_s", ".2f", None),
    ("tok/s", "output_tok_s_total", ".1f", None),
    ("u tok/s p50", "user_tok_s_p50", ".1f", None),
    ("u tok/s p10", "user_tok_s_p10", ".1f", None),
    ("u tok/s e2e", "user_tok_s_e2e_mean", ".1f", None),
    ("TTFT p50", "ttft_p50_s", ".3f", None),
    ("TTFT p99", "ttft_p99_s", ".3f", None),
    ("TPOT p50", "tpot_p50_s", ".4f", None),
    ("TPOT p99", "tpot_p99_s", ".4f", None),
    ("ITL p50", "itl_p50_s", ".4f", None),
    ("e2e p50", "e2e_p50_s", ".2f", None),
    ("goodput", "goodput_rps", ".2f", None),
    ("SLO", "slo_met", "", None),
    ("accept", "accept_len", ".2f", None),
    ("verify", "verify_len_mean", ".2f", None),
    ("cpu%", "client_cpu_share", ".1f", lambda v: 100 * v),
)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The per-stage table printed at the end of a run (times in s, '-' = not measured)."""
    head = [c[0] for c in COLUMNS]
    body = []
    for r in rows:
        line = []
        for _, key, spec, conv in COLUMNS:
            v = r.get(key)
            line.append(_fmt(conv(v) if (conv and v is not None) else v, spec))
        body.append(line)
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    lines = [" ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += [" ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)

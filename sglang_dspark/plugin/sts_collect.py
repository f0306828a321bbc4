"""`dspark_sts_recorder`: STS data collection from a running server that loses nothing.

`SGLANG_DSPARK_STS_COLLECT_PATH=stem` makes upstream 0.5.23 record, per verified block, the
confidence head's raw logits and how many drafts were accepted. Its recorder has three faults:
shards are written every 256 steps and never at shutdown (a short run writes nothing), every
rank writes the same file names, and in `compact` mode drafts the scheduler did not verify
are recorded as rejected (and its labels are the greedy argmax match, not the real outcome).

This hook takes the recording over (upstream's is bypassed for the step):

- labels are the worker's own accepted-draft count (`correct_len`: the verification outcome
  under greedy or rejection sampling), and each block stores `verified`, the drafts its verify
  window covered (gamma in static mode, verify_len - 1 in compact mode); the fitter leaves
  positions past the window out (`calibration.load_collector_shard`);
- files are `stem.rank<R>.<shard>.pt` with R the tensor/attention-DP rank;
- the open shard is rewritten (tmp file + rename) whenever a request finishes, so everything
  of a finished request is on disk; a shard is closed after `SGLANG_DSPARK_STS_FLUSH_EVERY`
  steps (default 64), and the rest is written at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch

from sglang_dspark.plugin import parallel
from sglang_dspark.plugin.registry import register_after, register_around


class StsRecorder:
    def __init__(self, stem: str, gamma: int, rank: int, flush_every: int = 64) -> None:
        self.stem = stem
        self.gamma = int(gamma)
        self.rank = int(rank)
        self.flush_every = max(1, int(flush_every))
        self.shard = 0
        self.steps = 0
        self._logits: list[torch.Tensor] = []
        self._prefix: list[torch.Tensor] = []
        self._verified: list[torch.Tensor] = []
        self._dirty = False
        atexit.register(self.flush)

    def path(self, shard: int | None = None) -> Path:
        return Path(f"{self.stem}.rank{self.rank}.{self.shard if shard is None else shard}.pt")

    def record(self, confidence_raw, correct_len, verified) -> None:
        logits = confidence_raw.detach().to("cpu", torch.float32)[:, : self.gamma]
        accepted = correct_len.detach().to("cpu", torch.int64).view(-1, 1)
        positions = torch.arange(logits.shape[1]).view(1, -1)
        self._logits.append(logits)
        self._prefix.append((positions < accepted).to(torch.float32))
        self._verified.append(verified.detach().to("cpu", torch.int64).view(-1))
        self._dirty = True
        self.steps += 1
        if self.steps % self.flush_every == 0:
            self.flush()
            self._logits, self._prefix, self._verified = [], [], []
            self.shard += 1

    def flush(self) -> None:
        if not self._dirty or not self._logits:
            return
        target = self.path()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        torch.save(
            {
                "logits": torch.cat(self._logits),
                "prefix_mask": torch.cat(self._prefix),
                "verified": torch.cat(self._verified),
            },
            tmp,
        )
        os.replace(tmp, target)
        self._dirty = False


def _observe_verify_step(original, observers, **kw):
    stem = observers._sts_collect_path
    if not stem:
        return original(observers, **kw)
    observers._sts_collect_path = ""  # upstream's recorder sits this step out
    try:
        result = original(observers, **kw)
    finally:
        observers._sts_collect_path = stem
    confidence_raw = kw.get("confidence_raw")
    correct_len = kw.get("correct_len")
    if confidence_raw is None or correct_len is None:
        return result
    recorder = getattr(observers, "_dspark_sts_recorder", None)
    if recorder is None:
        recorder = StsRecorder(
            stem,
            observers._gamma,
            parallel.global_rank(),
            int(os.environ.get("SGLANG_DSPARK_STS_FLUSH_EVERY", "64")),
        )
        observers._dspark_sts_recorder = recorder
    bs = int(kw.get("bs", confidence_raw.shape[0]))
    layout = kw.get("layout")
    if layout is not None and getattr(layout, "verify_lens", None) is not None:
        verified = (layout.verify_lens[:bs].to("cpu", torch.int64) - 1).clamp(0, recorder.gamma)
    else:
        verified = torch.full((bs,), recorder.gamma, dtype=torch.int64)
    recorder.record(confidence_raw[:bs], correct_len[:bs], verified)
    return result


def _flush_on_finish(result, observers, *args, **kwargs):
    recorder = getattr(observers, "_dspark_sts_recorder", None)
    if recorder is not None:
        recorder.flush()


def install() -> None:
    base = "sglang.srt.speculative.dspark_components.dspark_observability.DsparkStepObservers"
    register_around(f"{base}.observe_verify_step", _observe_verify_step)
    register_after(f"{base}.note_request_finished", _flush_on_finish)


HOOKS = {"dspark_sts_recorder": install}

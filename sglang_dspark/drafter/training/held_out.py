"""Held-out learning curves: per-position acceptance of the drafter on an evaluation set and
the accept length it implies (`--eval-data`, `eval.jsonl`)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch

from sglang_dspark.drafter.config import (
    DraftConfigError,
)
from sglang_dspark.drafter.training.batches import _EVAL_INDEX, _MicroBatch
from sglang_dspark.drafter.training.data import (
    BlockTargets,
    TokenSequence,
    _stable_seed,
    load_sequences,
)
from sglang_dspark.drafter.training.loss import (
    tv_ce,
)
from sglang_dspark.drafter.training.runtime import to_device

logger = logging.getLogger(__name__)


class HeldOutMixin:
    """`Trainer`'s held-out evaluation (see `train.Trainer`)."""

    def _eval_plan(self) -> list[tuple[TokenSequence, BlockTargets, BlockTargets]]:
        """Fixed blocks of the held-out sequences (this rank's share): num_anchors anchors
        each, drawn once from the seed, so every evaluation sees the same blocks."""
        seqs = load_sequences(self.cfg.eval_data, max_length=self.cfg.max_length)
        plan = [
            self._blocks(
                dataclasses.replace(seq, index=_EVAL_INDEX - i),
                _stable_seed(self.cfg.seed, "eval", i),
                0,
            )
            for i, seq in enumerate(seqs)
            if i % self.dist.world == self.dist.rank
        ]
        if not any(bt.valid.any() for _, bt, _ in plan) and self.dist.world == 1:
            raise DraftConfigError(
                f"eval_data {self.cfg.eval_data} has no response position to evaluate (every "
                "loss mask is empty or too short)"
            )
        return plan

    @torch.no_grad()
    def _position_accept(self, mb: _MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per draft position: the sum of 1 - TV/2 (teacher-forced, exact target logits)
        over this micro-batch's supervised positions, and their number."""
        hidden = self._block_hidden(mb)
        gamma = self.draft_config.block_size
        acc, cnt = (
            hidden.new_zeros(gamma, dtype=torch.float32),
            hidden.new_zeros(gamma, dtype=torch.float32),
        )
        for sl in self._loss_chunks(mb.full.numel(), gamma):
            idx = mb.full[sl]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                draft_logits = self.drafter.draft_logits(hidden[idx], mb.prev_tokens[idx])
            tv, _ = tv_ce(draft_logits, self._target_distribution(mb.target, sl), mb.labels[idx])
            valid = mb.valid[idx].float()
            acc += ((1.0 - 0.5 * tv) * valid).sum(0)
            cnt += valid.sum(0)
        return acc, cnt

    def evaluate(self) -> dict[str, Any]:
        """Held-out acceptance per draft position (see ``eval_data``) and the accept length
        it implies, 1 + sum_k prod_{j<=k} a_j (bonus token included)."""
        sums = torch.zeros(2, self.draft_positions, device=self.device)
        was_training = self.drafter.training
        self.drafter.eval()
        try:
            for i in range(0, len(self.eval_plan), self.cfg.micro_batch_size):
                mb = self._micro_batch(self.eval_plan[i : i + self.cfg.micro_batch_size],
                                       exact=True)  # fmt: skip
                if mb is None:
                    continue
                acc, cnt = self._position_accept(to_device(mb, self.device))
                sums[0] += acc
                sums[1] += cnt
        finally:
            self.drafter.train(was_training)
        sums = self.dist.all_reduce_(sums).cpu()
        a = (sums[0] / sums[1].clamp_min(1.0)).tolist()
        tau = 1.0 + float(torch.tensor(a).cumprod(0).sum())
        return {
            "step": self.step,
            "accept": [round(x, 5) for x in a],
            "positions": [int(x) for x in sums[1].tolist()],
            "tau_estimate": round(tau, 5),
        }

    def _log_eval(self, fh) -> None:
        rec = self.evaluate()
        if fh is not None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            logger.info(
                "held-out step %d: accept per position %s, accept length %.3f", rec["step"],
                " ".join(f"{x:.3f}" for x in rec["accept"]), rec["tau_estimate"],
            )  # fmt: skip

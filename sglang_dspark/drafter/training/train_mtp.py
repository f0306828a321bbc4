"""The MTP-1 baseline's hooks for :class:`train.Trainer` (``--drafter mtp``).

Everything but the drafter is the DSpark trainer's: data, StepSchedule, warmup-cosine AdamW,
clipping, checkpoint / bit-exact resume, feature cache, torchrun, metrics. Per sequence
x_0..x_{S-1} with target final hidden states h_0..h_{S-1}:

    C   = { i >= 0 : loss_mask[i+1] and loss_mask[i+2] }    (DSpark's anchors a = i+1, a >= 1)
    P   = seeded random subset of C, |P| = min(num_anchors * block_size, |C|)
          (generator seed _stable_seed(seed, epoch, idx), exactly as DSpark's anchors)
    rows i = 0..max(P): input (h_i, x_{i+1}) at position i, causal (``mtp.MtpDrafter``)
    L   = sum_{i in P} [ 0.1 * -log p_d,i(x_{i+2}) + 0.9 * || p_d,i - p_t,i ||_1 ] / |P|_global
          p_t,i = softmax(h_{i+1} W_lm^T): the target's next-next-token distribution

(``loss.loss_sums`` with gamma = 1: one position, weight 1, no confidence / Markov term.)
Rows after max(P) are never computed: attention is causal, so they cannot change P's rows.

Budget ("optimizer steps x positions through the LM head"): |P| <= num_anchors x block_size
rows per sequence go through the LM head, the same count as DSpark's num_anchors blocks of
block_size rows, so one MTP step costs one DSpark step (``lm_head_positions`` in metrics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.formats.checkpoint import load_mtp_draft, save_mtp_draft
from sglang_dspark.drafter.mtp import MtpDraftConfig, MtpDrafter
from sglang_dspark.drafter.training.batches import _EVAL_INDEX
from sglang_dspark.drafter.training.data import (
    TokenSequence,
    _stable_seed,
    anchor_candidates,
    load_sequences,
)
from sglang_dspark.drafter.training.loss import LossSums, loss_sums
from sglang_dspark.drafter.training.runtime import to_device
from sglang_dspark.drafter.training.target import TargetFeatures, pad_right
from sglang_dspark.drafter.training.train import Trainer

MtpPlan = list[tuple[TokenSequence, torch.Tensor]]  # (sequence, sorted supervised positions i)


def mtp_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Draft positions i with loss_mask[i+1] and loss_mask[i+2] (x_{i+1} is a response token,
    the input; x_{i+2} one too, the label). i = a - 1 for DSpark's anchor candidates a >= 1."""
    a = anchor_candidates(loss_mask)
    return a[a >= 1] - 1


def sample_mtp_positions(loss_mask: torch.Tensor, num_positions: int, seed: int) -> torch.Tensor:
    """Up to ``num_positions`` distinct candidates, sorted; the same generator procedure as
    ``train.sample_anchor_split``."""
    cand = mtp_candidates(loss_mask)
    if cand.numel() == 0:
        return cand
    perm = torch.randperm(cand.numel(), generator=torch.Generator().manual_seed(seed))
    return cand[perm[:num_positions]].sort().values


@dataclass
class _MtpMicroBatch:
    """One batched drafter call over a few sequences (rows 0..max(P) of each, right-padded)."""

    hidden: torch.Tensor  # [N, T, H] h_i
    next_tokens: torch.Tensor  # [N, T] x_{i+1}
    positions: torch.Tensor  # [N, T] i
    rows: torch.Tensor  # [R] supervised positions in the flattened N*T
    labels: torch.Tensor  # [R] x_{i+2}
    target: torch.Tensor  # [R, H] h_{i+1} (the target's logits are made chunk by chunk)


class MtpTrainer(Trainer):
    kind = "mtp"
    loss_terms = ("ce", "tv")

    # -------------------------------------------------------------- setup
    def _check_loss_options(self) -> None:
        cfg = self.cfg
        if cfg.drafter != self.kind:
            raise DraftConfigError(f"MtpTrainer needs drafter='mtp', got {cfg.drafter!r}")
        if cfg.target_topk:
            raise DraftConfigError(
                "target_topk is implemented for the DSpark trainer only; use 0 with --drafter mtp."
            )
        if cfg.dflash:
            raise DraftConfigError("dflash switches off a DSpark Markov head; MTP-1 has none.")
        if cfg.grow_layers or cfg.grow_markov_rank:
            raise DraftConfigError(
                "grow_layers / grow_markov_rank grow a DSpark drafter; drop them with --drafter mtp."
            )
        if cfg.mse_weight or cfg.dense_anchors:
            raise DraftConfigError(
                "mse_weight / dense_anchors are DSpark-only (the MSE term reads the Markov "
                "head); set them to 0 with --drafter mtp."
            )

    @property
    def positions_per_sequence(self) -> int:
        return self.cfg.num_anchors * self.cfg.block_size

    def _draft_config(self, target_config: dict) -> MtpDraftConfig:
        if self.cfg.init_draft:
            return MtpDraftConfig.load(self.cfg.init_draft)
        return MtpDraftConfig.for_target(target_config)

    def _draft_problems(self, target_config: dict) -> list[str]:
        return self.draft_config.problems_for_target(target_config)

    def _target_layer_ids(self) -> list[int]:
        # Placeholder for the adapter's capture list: the MTP layer reads only the final
        # hidden state, which _compute_features takes without any capture hook.
        return [0]

    def _target_forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> TargetFeatures:
        """The target's final normed hidden state only (what SGLang hands an EAGLE draft
        with use_aux_hidden_state false); context is empty [N, S, 0]."""
        final = self.target.base(input_ids=ids, attention_mask=mask, use_cache=False)
        final = final.last_hidden_state
        return TargetFeatures(final.new_zeros(*final.shape[:2], 0), final)

    def _new_drafter(self) -> MtpDrafter:
        return MtpDrafter(self.draft_config)

    def _load_drafter(self, path: str) -> MtpDrafter:
        return load_mtp_draft(path, target_config=self.target.config)

    # -------------------------------------------------------------- one step
    def _plan(self, step: int) -> MtpPlan:
        epoch, samples = self.schedule.samples(step)
        local = samples[self.dist.rank :: self.dist.world]
        return [
            (
                self.sequences[idx],
                sample_mtp_positions(
                    self.sequences[idx].loss_mask,
                    self.positions_per_sequence,
                    _stable_seed(self.cfg.seed, epoch, idx),
                ),
            )
            for idx in local
        ]

    def _weight_totals(self, plan: MtpPlan) -> torch.Tensor:
        n = torch.tensor(float(sum(pos.numel() for _, pos in plan)))
        return torch.stack([n, n])  # weight 1 per supervised position; no MSE term

    def _lm_head_positions(self, plan: MtpPlan) -> int:
        return sum(pos.numel() for _, pos in plan)

    # -------------------------------------------------------------- held-out evaluation
    @property
    def draft_positions(self) -> int:
        return 1

    def _eval_plan(self) -> MtpPlan:
        """Fixed positions of the held-out sequences (this rank's share), drawn once."""
        seqs = load_sequences(self.cfg.eval_data, max_length=self.cfg.max_length)
        plan = [
            (dataclasses.replace(seq, index=_EVAL_INDEX - i),
             sample_mtp_positions(seq.loss_mask, self.positions_per_sequence,
                                  _stable_seed(self.cfg.seed, "eval", i)))
            for i, seq in enumerate(seqs)
            if i % self.dist.world == self.dist.rank
        ]  # fmt: skip
        if not any(pos.numel() for _, pos in plan) and self.dist.world == 1:
            raise DraftConfigError(f"eval_data {self.cfg.eval_data} has no response position "
                                   "to evaluate (every loss mask is empty or too short)")  # fmt: skip
        return plan

    @torch.no_grad()
    def _position_accept(self, mb: _MtpMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of 1 - TV/2 against the target (its next-next-token distribution) over the
        micro-batch's positions, and their number; [1] each."""
        h = self._block_hidden(mb)
        acc = h.new_zeros(1, dtype=torch.float32)
        for sl in self._loss_chunks(mb.rows.numel(), 1):
            acc += self._head_sums(h, mb, sl).accept
        return acc, acc.new_full((1,), float(mb.rows.numel()))

    # -------------------------------------------------------------- micro-batches
    def _micro_batch(self, items: Sequence[tuple[TokenSequence, torch.Tensor]], *,
                     exact: bool = False):  # fmt: skip
        """``exact`` is the DSpark trainer's (top-k targets); MTP-1 always uses exact logits."""
        items = [(seq, pos) for seq, pos in items if pos.numel()]
        if not items:
            return None
        feats = self._features([seq for seq, _ in items])
        T = max(int(pos[-1]) + 1 for _, pos in items)  # rows 0..max(P) (CPU tensors)
        final = pad_right([f.final_hidden for f in feats])  # [N, S, H]
        seq_of = torch.cat([torch.full_like(pos, i) for i, (_, pos) in enumerate(items)])
        pos = torch.cat([pos for _, pos in items])
        dev = final.device
        return _MtpMicroBatch(
            hidden=final[:, :T],  # causal: rows after max(P) cannot change P's rows
            next_tokens=pad_right([seq.input_ids[1 : T + 1] for seq, _ in items]),
            positions=torch.arange(T).expand(len(items), T),
            rows=seq_of * T + pos,
            labels=torch.cat([seq.input_ids[p + 2] for seq, p in items]),
            target=final[to_device((seq_of, pos + 1), dev)],
        )

    def _block_hidden(self, mb: _MtpMicroBatch) -> torch.Tensor:
        """o_i [R, H] at the supervised positions."""
        with self._timed("drafter"), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                                     enabled=self.bf16):  # fmt: skip
            out = self.drafter(mb.hidden, mb.next_tokens, mb.positions)
            return out.flatten(0, 1)[mb.rows]  # [R, H]

    def _head_items(self, mb: _MtpMicroBatch) -> tuple[int, int]:
        return mb.rows.numel(), 1

    def _head_sums(self, h: torch.Tensor, mb: _MtpMicroBatch, sl: slice) -> LossSums:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            draft_logits = self.drafter.logits(h[sl])
        with torch.no_grad():
            target_logits = self.target.logits(mb.target[sl])
        labels = mb.labels[sl]
        one = torch.ones(labels.shape[0], 1, dtype=torch.bool, device=labels.device)
        return loss_sums(
            draft_logits[:, None], target_logits[:, None], labels[:, None], one, None, decay=0.0
        )

    # -------------------------------------------------------------- export
    def export(self) -> Path:
        out = self.out_dir / "draft"
        if self.dist.main:
            save_mtp_draft(self.drafter, out, dtype=getattr(torch, self.cfg.export_dtype))
        if self.dist.world > 1:
            dist.barrier()
        return out

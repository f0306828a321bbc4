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

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import load_mtp_draft, save_mtp_draft
from .config import DraftConfigError
from .data import TokenSequence, _stable_seed, anchor_candidates
from .loss import LossSums, loss_sums
from .mtp import MtpDraftConfig, MtpDrafter
from .target import TargetFeatures
from .train import Trainer

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
    """One packed drafter call over a few sequences (rows 0..max(P) of each)."""

    hidden: torch.Tensor  # [N, H] h_i
    next_tokens: torch.Tensor  # [N] x_{i+1}
    positions: torch.Tensor  # [N] i
    seq_lens: list[int]
    rows: torch.Tensor  # [R] packed row index of each supervised position
    labels: torch.Tensor  # [R] x_{i+2}
    target_logits: torch.Tensor  # [R, V] h_{i+1} W_lm^T


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
        if cfg.grow_layers or cfg.grow_markov_rank or cfg.eval_data:
            raise DraftConfigError(
                "grow_layers / grow_markov_rank / eval_data are implemented for the DSpark trainer; drop them with "
                "--drafter mtp (compare MTP-1 drafters with `sglang-dspark compare`)."
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

    @torch.no_grad()
    def _compute_features(self, input_ids: torch.Tensor) -> TargetFeatures:
        """The target's final normed hidden state only (what SGLang hands an EAGLE draft
        with use_aux_hidden_state false); context is empty [S, 0]."""
        out = self.target.base(input_ids=input_ids[None].to(self.device), use_cache=False)
        final = out.last_hidden_state[0]
        return TargetFeatures(final.new_zeros(final.shape[0], 0), final)

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

    def _micro_batch(self, items: Sequence[tuple[TokenSequence, torch.Tensor]]):
        hidden, tokens, positions, lens, rows, labels, teacher = [], [], [], [], [], [], []
        offset = 0
        for seq, pos in items:
            if pos.numel() == 0:
                continue
            final = self._target_features(seq).final_hidden
            n = int(pos[-1]) + 1  # rows 0..max(P)
            hidden.append(final[:n])
            tokens.append(seq.input_ids[1 : n + 1])
            positions.append(torch.arange(n))
            lens.append(n)
            rows.append(offset + pos)
            labels.append(seq.input_ids[pos + 2])
            teacher.append(final[pos + 1])
            offset += n
        if not lens:
            return None
        with torch.no_grad():  # hidden-state communication: LM head only where needed
            target_logits = self.target.logits(torch.cat(teacher))
        return _MtpMicroBatch(
            hidden=torch.cat(hidden),
            next_tokens=torch.cat(tokens),
            positions=torch.cat(positions),
            seq_lens=lens,
            rows=torch.cat(rows),
            labels=torch.cat(labels),
            target_logits=target_logits,
        )

    def _micro_batch_loss(self, mb: _MtpMicroBatch) -> LossSums:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.drafter(mb.hidden, mb.next_tokens, mb.positions, mb.seq_lens)
            draft_logits = self.drafter.logits(out[mb.rows])
        one = torch.ones(mb.labels.shape[0], 1, dtype=torch.bool, device=mb.labels.device)
        return loss_sums(
            draft_logits[:, None], mb.target_logits[:, None], mb.labels[:, None], one, None,
            decay=0.0,
        )  # fmt: skip

    # -------------------------------------------------------------- export
    def export(self) -> Path:
        out = self.out_dir / "draft"
        if self.dist.main:
            save_mtp_draft(self.drafter, out, dtype=getattr(torch, self.cfg.export_dtype))
        if self.dist.world > 1:
            dist.barrier()
        return out

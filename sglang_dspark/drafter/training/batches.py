"""The trainer's data side: the blocks of a step, its micro-batches, and the target's features
for them (one batched forward per micro-batch, cached within a memory budget)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_dspark.drafter.model import BlockLayout
from sglang_dspark.drafter.training.data import (
    BlockTargets,
    TokenSequence,
    _stable_seed,
    block_targets,
    sample_anchor_split,
)
from sglang_dspark.drafter.training.loss import (
    TargetTopK,
    position_weights,
)
from sglang_dspark.drafter.training.runtime import to_device
from sglang_dspark.drafter.training.target import (
    TargetFeatures,
    pad_right,
    padded_batch,
)

logger = logging.getLogger(__name__)


@dataclass
class _MicroBatch:
    """One batched drafter call: every block of a few sequences.

    The drafter returns [N, A, gamma, H]; ``rows`` picks the B real blocks out of its N*A
    (sequence by sequence: full-loss blocks, then dense ones); ``full`` indexes the full-loss
    blocks among the B. Index tensors are built on the CPU, so nothing here syncs the device.
    """

    context: torch.Tensor  # [N, S, m*H] target features, right-padded
    layout: BlockLayout  # batched: [N, A, gamma]
    rows: torch.Tensor  # [B] real blocks in the flattened N*A
    full: torch.Tensor  # [B_full] full-loss blocks among the B
    labels: torch.Tensor  # [B, gamma]
    prev_tokens: torch.Tensor  # [B, gamma]
    valid: torch.Tensor  # [B, gamma]
    # The target at each full block's positions: its final hidden state [B_full, gamma, H]
    # (logits made chunk by chunk in the loss) or its top-k ([B_full, gamma, k]).
    target: torch.Tensor | TargetTopK | None
    target_hidden: torch.Tensor | None  # [B, gamma, H] (only with the MSE term)


# -1 stays "not from a dataset".
_EVAL_INDEX = -2


class BatchingMixin:
    """`Trainer`'s plan, micro-batches and target features (see `train.Trainer`)."""

    # -------------------------------------------------------------- one step
    def _plan(self, step: int) -> list[tuple[TokenSequence, BlockTargets, BlockTargets]]:
        """(sequence, full-loss blocks, dense-MSE-only blocks) for this rank's samples."""
        epoch, samples = self.schedule.samples(step)
        local = samples[self.dist.rank :: self.dist.world]
        seed = self.cfg.seed
        dense = self.cfg.dense_anchors
        return [self._blocks(self.sequences[i], _stable_seed(seed, epoch, i), dense) for i in local]

    def _blocks(
        self, seq: TokenSequence, seed: int, num_dense: int
    ) -> tuple[TokenSequence, BlockTargets, BlockTargets]:
        """``seq`` with num_anchors full-loss blocks and ``num_dense`` dense-MSE-only ones."""
        gamma = self.draft_config.block_size
        full, dense = sample_anchor_split(seq.loss_mask, self.cfg.num_anchors, num_dense, seed)
        return seq, block_targets(seq, full, gamma), block_targets(seq, dense, gamma)

    def _weight_totals(self, plan: list) -> torch.Tensor:
        """This rank's [loss normaliser, MSE normaliser]: sums of w_k over supervised
        positions (all-reduced by the caller, so the loss is normalised globally)."""
        w = position_weights(self.draft_config.block_size, self.cfg.decay)
        full_w = torch.stack([(bt.valid.float() * w).sum() for _, bt, _ in plan]).sum()
        dense_w = torch.stack([(d.valid.float() * w).sum() for _, _, d in plan]).sum()
        return torch.stack([full_w, full_w + dense_w])

    def _lm_head_positions(self, plan: list) -> int:
        """Budget: rows through the vocabulary projection (every full block's gamma rows;
        dense blocks use the Gram-matrix MSE, no LM head)."""
        return sum(bt.anchors.numel() for _, bt, _ in plan) * self.draft_config.block_size

    def _micro_batch(
        self, items: Sequence[tuple[TokenSequence, BlockTargets, BlockTargets]], *,
        exact: bool = False,
    ):  # fmt: skip
        """Run the target over ``items``' sequences (one batched forward for those not cached)
        and lay out every block for one batched drafter call: per sequence its full-loss
        blocks, then its dense (MSE-only) ones. ``exact``: the target's full distribution
        even when training on its top-k (held-out evaluation)."""
        items = [it for it in items if it[1].anchors.numel() + it[2].anchors.numel()]
        if not items:
            return None
        gamma = self.draft_config.block_size
        feats = self._features([seq for seq, _, _ in items])
        counts = [bt.anchors.numel() + dense.anchors.numel() for _, bt, dense in items]
        N, A = len(items), max(counts)
        block_ids = torch.full((N, A, gamma), self.draft_config.mask_token_id)
        ctx_hi = torch.zeros(N, A, dtype=torch.long)  # padding blocks see no context
        targets: list[BlockTargets] = []
        seq_of, is_full = [], []
        for i, (_, bt, dense) in enumerate(items):
            parts = [p for p in (bt, dense) if p.anchors.numel()]
            anchors = torch.cat([p.anchors for p in parts])
            block_ids[i, : anchors.numel(), 0] = torch.cat([p.prev_tokens[:, 0] for p in parts])
            ctx_hi[i, : anchors.numel()] = anchors  # context strictly before the anchor
            targets += parts
            seq_of.append(torch.full((anchors.numel(),), i))
            is_full += [torch.full_like(p.anchors, p is bt, dtype=torch.bool) for p in parts]
        cat = lambda name: torch.cat([getattr(t, name) for t in targets])
        seq_of, is_full = torch.cat(seq_of), torch.cat(is_full)
        rows = (torch.arange(N)[:, None] * A + torch.arange(A)).flatten()
        rows = rows[(torch.arange(A) < torch.tensor(counts)[:, None]).flatten()]
        anchors_all = ctx_hi.flatten()[rows]
        positions = torch.zeros(N, A, gamma, dtype=torch.long)
        positions.view(N * A, gamma)[rows] = anchors_all[:, None] + torch.arange(gamma)
        context = pad_right([f.context for f in feats])
        S = context.shape[1]
        layout = BlockLayout(
            block_ids=block_ids,
            positions=positions,
            ctx_positions=torch.arange(S).expand(N, S),
            ctx_lo=torch.zeros(N, A, dtype=torch.long),
            ctx_hi=ctx_hi,
        )
        full = is_full.nonzero().squeeze(-1)  # CPU
        tpos = cat("target_pos")  # [B, gamma] positions within each block's sequence
        need_final = bool(full.numel()) and (exact or not self.cfg.target_topk)
        final = (
            pad_right([f.final_hidden for f in feats])
            if need_final or self.cfg.mse_weight
            else None
        )
        dev = context.device  # the features' rows of each block's target positions
        at = lambda t: to_device((seq_of[:, None], tpos) if t is None else (
            seq_of[t][:, None], tpos[t]), dev)  # fmt: skip
        target = None
        if full.numel() and self.cfg.target_topk and not exact:
            ids = pad_right([f.topk_ids for f in feats])
            logp = pad_right([f.topk_logp for f in feats])
            target = TargetTopK(ids[at(full)], logp[at(full)])
        elif full.numel():
            target = final[at(full)]
        return _MicroBatch(
            context=context,
            layout=layout,
            rows=rows,
            full=full,
            labels=cat("labels"),
            prev_tokens=cat("prev_tokens"),
            valid=cat("valid"),
            target=target,
            target_hidden=final[at(None)] if self.cfg.mse_weight else None,
        )

    # -------------------------------------------------------------- target features
    def _feature_row_bytes(self) -> int:
        """Bytes of one token's cached features (context, final hidden, top-k)."""
        width = len(self._target_layer_ids()) * self.draft_config.hidden_size
        width += self.draft_config.hidden_size
        size = torch.empty((), dtype=getattr(torch, self.cfg.target_dtype)).element_size()
        return width * size + self.cfg.target_topk * 8

    def _plan_cache(self) -> None:
        """The cacheable groups: training sequences sorted by length (then index), in groups
        of target_batch_size, admitted in that order while the budget holds them. No group when
        the run reads each sequence at most once (steps x global batch within one epoch): a cached
        group would only be computed ahead and held, never read again. A function of the data
        and the config only."""
        self._groups = []
        reads = self.total_steps * self.cfg.global_batch_size
        if reads <= len(self.sequences):
            if self.dist.main and self.cfg.feature_cache_gb:
                logger.info("feature cache: off, %d steps of %d read each of the %d sequences at "
                            "most once", self.total_steps, self.cfg.global_batch_size,
                            len(self.sequences))  # fmt: skip
            return
        order = sorted(range(len(self.sequences)),
                       key=lambda i: (self.sequences[i].input_ids.numel(), i))  # fmt: skip
        budget, row = self.cfg.feature_cache_gb * 2**30, self._feature_row_bytes()
        g, used = max(1, self.cfg.target_batch_size), 0
        for start in range(0, len(order), g):
            group = order[start : start + g]
            size = row * sum(self.sequences[i].input_ids.numel() for i in group)
            if used + size > budget:
                break
            used += size
            for i in group:
                self._group_of[i] = len(self._groups)
            self._groups.append(group)
        if self.dist.main and self.cfg.feature_cache_gb:
            logger.info("feature cache: %d of %d sequences fit in %.1f GiB on %s (%.2f GiB)",
                        len(self._group_of), len(self.sequences), self.cfg.feature_cache_gb,
                        self.device, used / 2**30)  # fmt: skip

    def _features(self, seqs: Sequence[TokenSequence]) -> list[TargetFeatures]:
        """Each sequence's target features on the training device: from the in-memory cache,
        else the feature store, else the target (the target is frozen, so a sequence's
        features never change). A cacheable sequence is computed with its whole group (one
        forward) and the group cached; the rest in one forward over those of this call.
        Held-out sequences (index <= _EVAL_INDEX) keep theirs in a cache of their own."""
        if self._groups is None:
            self._plan_cache()
        out: list[TargetFeatures | None] = []
        for seq in seqs:
            cache = self._eval_features if seq.index <= _EVAL_INDEX else self._features_cache
            out.append(cache.get(seq.index))
        if self._store is not None:  # a stored sequence comes back on the CPU
            for i, seq in enumerate(seqs):
                if out[i] is None:
                    f = self._store.load(seq.input_ids)
                    if f is not None:
                        out[i] = to_device(f, self.device)
                        self._cache_features(seq, out[i])
        groups = sorted({self._group_of[s.index] for s, f in zip(seqs, out)
                         if f is None and s.index in self._group_of})  # fmt: skip
        for g in groups:
            members = [self.sequences[i] for i in self._groups[g]]
            for seq, f in zip(
                members, self._compute_features_batch([m.input_ids for m in members])
            ):
                self._cache_features(seq, f)
                if self._store is not None:
                    self._store.save(seq.input_ids, f)
        for i, seq in enumerate(seqs):
            if out[i] is None and seq.index in self._group_of:
                out[i] = self._features_cache[seq.index]
        rest = [i for i, f in enumerate(out) if f is None]
        if rest:
            for i, f in zip(rest, self._compute_features_batch([seqs[i].input_ids for i in rest])):
                out[i] = f
                if self._store is not None:
                    self._store.save(seqs[i].input_ids, f)
                self._cache_features(seqs[i], f)
        return out  # type: ignore[return-value]

    def _cache_features(self, seq: TokenSequence, feats: TargetFeatures) -> None:
        """Keep a copy (own storage, not the batch's) of a held-out or cacheable sequence's."""
        if seq.index <= _EVAL_INDEX:
            if self.cfg.feature_cache_gb:
                self._eval_features[seq.index] = feats.clone()
        elif seq.index in self._group_of:
            self._features_cache[seq.index] = feats.clone()

    def _timed(self, phase: str):
        return self.timer(phase) if self.timer is not None else contextlib.nullcontext()

    def _target_forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> TargetFeatures:
        """The target over right-padded ids [N, S] (mask [N, S] or None): features [N, S, ..]."""
        return self.target.features(ids, attention_mask=mask)

    @torch.no_grad()
    def _compute_features_batch(self, input_ids: Sequence[torch.Tensor]) -> list[TargetFeatures]:
        """One target forward over these sequences (right-padded), split back per sequence
        (views of the batch, real rows only), with the top-k when the loss uses it."""
        ids, mask = padded_batch(input_ids)
        lens = [t.numel() for t in input_ids]
        with self._timed("target"):
            batch = self._target_forward(to_device(ids, self.device), to_device(mask, self.device))
            out = [
                TargetFeatures(batch.context[i, :n], batch.final_hidden[i, :n])
                for i, n in enumerate(lens)
            ]
            if self.cfg.target_topk:
                real = torch.cat([batch.final_hidden[i, :n] for i, n in enumerate(lens)])
                top = TargetTopK.from_logits(self.target.logits(real), self.cfg.target_topk)
                for f, tid, tlp in zip(out, top.ids.split(lens), top.logp.split(lens)):
                    f.topk_ids, f.topk_logp = tid, tlp
        return out

    def _compute_features(self, input_ids: torch.Tensor) -> TargetFeatures:
        """One sequence's features alone (the per-sequence reference of the batched path)."""
        return self._compute_features_batch([input_ids])[0]

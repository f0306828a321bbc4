"""Train a DSpark drafter (or the MTP-1 baseline, ``--drafter mtp``) against a frozen target.

    python -m sglang_dspark.drafter.training.train --data train.jsonl --target TARGET_DIR --out-dir RUN
    torchrun --nproc_per_node 2 -m sglang_dspark.drafter.training.train ...      (gloo on CPU)

Data: JSONL token sequences with a loss mask on the response (format in ``data.py``).

Each optimizer step takes ``global_batch_size`` sequences (split over ranks), places up to
``num_anchors`` random anchors per sequence and, per micro-batch, runs the target once over
the micro-batch's sequences (right-padded; context features + final hidden state) and the
drafter once over every block (batched ``BlockLayout``: a block attends to its own sequence's
rows only). The vocabulary terms run a chunk of ``loss_chunk_rows`` LM-head rows at a time,
each chunk's backward into the drafter's hidden states before the next (the target's logits
for a chunk are made inside it), so no [rows, V] tensor of a whole micro-batch exists and
micro-batches of 32-128 sequences fit. Nothing in a step waits on the device but the one
read of the step's statistics at its end. Loss: ``loss.py``. The loss normaliser is the
global sum of position weights, and gradients are summed over ranks, so N ranks compute the
same update as one.
Anchors and data order are functions of (seed, epoch, sample index) only: a resumed run
replays exactly what an uninterrupted one would have done.

``--drafter mtp`` trains the MTP-1 / NextN baseline (``mtp.py``, ``train_mtp.py``) with
everything else shared: data, schedule, optimiser, loss (0.1 CE + 0.9 TV), checkpoints,
resume, feature cache, torchrun, metrics. Budget: both kinds push at most
``global_batch_size x num_anchors x block_size`` positions through the LM head per step;
metrics.jsonl logs the actual count (``lm_head_positions``) and that cap (``lm_head_budget``).

Checkpoints: ``OUT/checkpoints/latest.pt`` every ``checkpoint_every`` steps (tmp file +
os.replace, so a kill -9 loses at most the steps since the last one); a rerun with the same
``--out-dir`` resumes from it. The final drafter is exported to ``OUT/draft`` (SGLang format).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from sglang_dspark.drafter.config import (
    DraftConfigError,
    DSparkDraftConfig,
    validate_draft_for_target,
)
from sglang_dspark.drafter.formats.checkpoint import (
    DraftCheckpointError,
    load_draft,
    load_training_checkpoint,
    save_draft,
)
from sglang_dspark.drafter.model import DSparkDrafter, init_weights
from sglang_dspark.drafter.training.data import (
    load_sequences,
)
from sglang_dspark.drafter.training.feature_store import FeatureStore, store_key
from sglang_dspark.drafter.training.loss import (
    LogitGram,
    LossSums,
    TargetTopK,
    combine,
    loss_sums,
    position_weights,
)
from sglang_dspark.drafter.training.target import (
    TargetAdapter,
    TargetFeatures,
    load_target_config,
)

logger = logging.getLogger(__name__)

from sglang_dspark.drafter.training.batches import BatchingMixin, _MicroBatch
from sglang_dspark.drafter.training.config import (
    StepSchedule,
    TrainConfig,
    warmup_cosine,
)
from sglang_dspark.drafter.training.growth import (
    copy_target_layers,
    disable_markov_bias,
    grow_drafter,
)
from sglang_dspark.drafter.training.held_out import HeldOutMixin
from sglang_dspark.drafter.training.runtime import (
    PhaseTimer,
    StopSignals,
    _Dist,
    _use_bf16,
    resolve_device,
    to_device,
)

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    loss: float
    accept: float  # mean 1 - TV/2 over supervised positions (acceptance proxy)
    tokens: int
    lr: float
    grad_norm: float
    per_term: dict[str, float] = field(default_factory=dict)
    lm_head_positions: int = 0  # budget: drafter positions through the LM head this step


# Held-out sequences are indexed _EVAL_INDEX, _EVAL_INDEX - 1, ... (their own feature cache);


class Trainer(BatchingMixin, HeldOutMixin):
    """The DSpark trainer. ``train_mtp.MtpTrainer`` (``build_trainer`` picks it for
    ``cfg.drafter == "mtp"``) overrides only the drafter-specific hooks (draft config, target
    features, new/loaded drafter, plan, micro-batch, loss, export)."""

    kind = "dspark"
    loss_terms: tuple[str, ...] = ("ce", "tv", "conf")

    def __init__(self, cfg: TrainConfig, *, dist_ctx: _Dist | None = None) -> None:
        self.cfg = cfg
        self.dist = dist_ctx or _Dist()
        if cfg.global_batch_size % self.dist.world:
            raise DraftConfigError(
                f"global_batch_size {cfg.global_batch_size} is not divisible by the "
                f"{self.dist.world} ranks"
            )
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_path = self.out_dir / "checkpoints" / "latest.pt"
        target_config = load_target_config(cfg.target)
        self.draft_config = self._draft_config(target_config)
        problems = self._draft_problems(target_config)
        if problems:
            raise DraftConfigError("cannot train this drafter:\n  - " + "\n  - ".join(problems))
        self._check_loss_options()
        self.device = resolve_device(cfg.device)
        self.target = TargetAdapter.from_pretrained(
            cfg.target, self._target_layer_ids(), dtype=getattr(torch, cfg.target_dtype)
        )
        self.target.model.to(self.device)
        self.drafter = self._build_drafter()
        self.drafter.attach_shared(self.target.embed_weight, self.target.lm_head_weight)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.sequences = load_sequences(cfg.data, max_length=cfg.max_length)
        vocab = self.draft_config.vocab_size
        for i, s in enumerate(self.sequences):
            if int(s.input_ids.max()) >= vocab or int(s.input_ids.min()) < 0:
                raise DraftConfigError(
                    f"sequence {i} of {cfg.data} has token id {int(s.input_ids.max())} outside "
                    f"the target vocabulary ({vocab}); was it tokenized for another model?"
                )
        self.eval_plan = self._eval_plan() if cfg.eval_data else []
        self._eval_features: dict[int, TargetFeatures] = {}
        self.schedule = StepSchedule(len(self.sequences), cfg.global_batch_size, cfg.seed)
        self.total_steps = cfg.steps or cfg.epochs * self.schedule.steps_per_epoch
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
        )
        self.bf16 = _use_bf16(cfg.precision, self.device)
        self.lm_head_budget = cfg.global_batch_size * cfg.num_anchors * cfg.block_size
        self._gram = LogitGram(self.target.lm_head_weight) if cfg.mse_weight else None
        self._features_cache: dict[int, TargetFeatures] = {}
        self._groups: list[list[int]] | None = None  # cacheable groups (see feature_cache_gb)
        self._group_of: dict[int, int] = {}
        self._store = None
        if cfg.feature_store:
            kind = type(self).__name__ + (f"+top{cfg.target_topk}" if cfg.target_topk else "")
            key = store_key(cfg.target, cfg.target_dtype, self._target_layer_ids(), kind)
            self._store = FeatureStore(cfg.feature_store, key)
        self.timer: PhaseTimer | None = None
        self.step = 0
        if cfg.resume and self.ckpt_path.is_file():
            self._resume()

    # -------------------------------------------------------------- setup (drafter hooks)
    def _check_loss_options(self) -> None:
        cfg = self.cfg
        if cfg.target_topk < 0:
            raise DraftConfigError(f"target_topk is {cfg.target_topk}; use 0 (off) or k > 0")
        if cfg.dense_anchors and not cfg.mse_weight:
            raise DraftConfigError(
                f"dense_anchors={cfg.dense_anchors} needs mse_weight > 0: dense blocks are "
                "supervised by the centred-logit MSE only"
            )
        if cfg.grow_layers < 0:
            raise DraftConfigError(f"grow_layers is {cfg.grow_layers}; use 0 (off) or n > 0")
        if (cfg.grow_layers or cfg.grow_markov_rank) and not cfg.init_draft:
            raise DraftConfigError(
                "grow_layers / grow_markov_rank grow a trained drafter: give --init-draft (a "
                "new drafter takes --num-layers / --markov-rank instead)"
            )
        if cfg.eval_every < 0:
            raise DraftConfigError(f"eval_every is {cfg.eval_every}; use 0 or n > 0 steps")

    def _draft_problems(self, target_config: dict) -> list[str]:
        return validate_draft_for_target(self.draft_config, target_config)

    def _target_layer_ids(self) -> list[int]:
        """Target layers whose outputs the drafter reads (the adapter captures them)."""
        return list(self.draft_config.target_layer_ids)

    def _draft_config(self, target_config: dict) -> DSparkDraftConfig:
        cfg = self.cfg
        if cfg.init_draft:
            loaded = DSparkDraftConfig.load(cfg.init_draft)
            if cfg.grow_markov_rank and cfg.grow_markov_rank < loaded.markov_rank:
                raise DraftConfigError(
                    f"grow_markov_rank {cfg.grow_markov_rank} is below the draft's Markov rank "
                    f"{loaded.markov_rank}; a drafter only grows"
                )
            return dataclasses.replace(
                loaded,
                num_hidden_layers=loaded.num_hidden_layers + max(cfg.grow_layers, 0),
                markov_rank=cfg.grow_markov_rank or loaded.markov_rank,
            )
        return DSparkDraftConfig.for_target(
            target_config,
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            markov_rank=cfg.markov_rank,
            markov_head_type=cfg.markov_head_type,
            target_layer_ids=cfg.target_layer_ids,
            num_context_features=cfg.num_context_features,
            mask_token_id=cfg.mask_token_id,
            enable_confidence_head=True,
            confidence_head_with_markov=True,
        )

    def _new_drafter(self) -> torch.nn.Module:
        return DSparkDrafter(self.draft_config)

    def _load_drafter(self, path: str) -> torch.nn.Module:
        return load_draft(path, target_config=self.target.config)

    def _build_drafter(self) -> torch.nn.Module:
        if self.cfg.init_draft:
            drafter = self._load_drafter(self.cfg.init_draft)
            if self.cfg.grow_layers or self.cfg.grow_markov_rank:
                drafter = grow_drafter(
                    drafter, self.cfg.grow_layers, markov_rank=self.cfg.grow_markov_rank,
                    seed=self.cfg.seed,
                )  # fmt: skip
        else:
            drafter = self._new_drafter()
            init_weights(drafter, seed=self.cfg.seed)
            if self.cfg.init_layers_from_target:
                copy_target_layers(drafter, self.target.layers, self.cfg.init_layers_from_target)
        if self.cfg.dflash:
            disable_markov_bias(drafter)
        drafter = drafter.float().to(self.device)
        if self.dist.world > 1:  # identical start on every rank
            for p in drafter.parameters():
                dist.broadcast(p.data, src=0)
        return drafter.train()

    def _resume(self) -> None:
        state = load_training_checkpoint(self.ckpt_path)
        if state.get("draft_config") != self.draft_config.to_sglang_dict():
            raise DraftCheckpointError(
                f"{self.ckpt_path} belongs to a different drafter (config differs); use another "
                "--out-dir, or --no-resume to start over"
            )
        self.drafter.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if self.dist.main:
            logger.info("resumed from %s at step %d", self.ckpt_path, self.step)
            for log in ("metrics.jsonl", "eval.jsonl"):
                path = self.out_dir / log
                if path.is_file():  # drop the lost steps; they are about to be redone
                    kept = [
                        line
                        for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= self.step
                    ]
                    path.write_text("".join(line + "\n" for line in kept))

    def save_checkpoint(self) -> None:
        if self.dist.main:
            self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
            state = {
                "step": self.step,
                "model": self.drafter.trainable_state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "draft_config": self.draft_config.to_sglang_dict(),
                "train_config": dataclasses.asdict(self.cfg),
            }
            tmp = self.ckpt_path.with_name(f".{self.ckpt_path.name}.tmp")
            torch.save(state, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, self.ckpt_path)
        if self.dist.world > 1:
            dist.barrier()

    # -------------------------------------------------------------- one step
    def train_step(self) -> StepStats:
        cfg = self.cfg
        plan = self._plan(self.step)
        totals_w = to_device(self.dist.all_reduce_(self._weight_totals(plan)), self.device)
        weight_total, mse_weight_total = totals_w[0], totals_w[1]
        totals = LossSums.zeros(self.device)
        tokens = 0
        for i in range(0, len(plan), cfg.micro_batch_size):
            items = plan[i : i + cfg.micro_batch_size]
            tokens += sum(item[0].input_ids.numel() for item in items)
            mb = self._micro_batch(items)
            if mb is None:
                continue
            mb = to_device(mb, self.device)
            totals = totals + self._forward_backward(mb, weight_total, mse_weight_total)
        with self._timed("optimizer"):
            for p in self.params:  # sum gradients over ranks (the loss is globally normalised)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.dist.all_reduce_(p.grad)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        counts = torch.tensor(
            [float(tokens), float(self._lm_head_positions(plan))], device=self.device
        )
        stats = self.dist.all_reduce_(torch.cat([totals.as_tensor(), counts]))
        stats = torch.cat([stats, grad_norm.detach().float().reshape(1)]).tolist()  # one sync
        ce, tv, conf, weight, accept, count, mse, mse_weight, tok, lm_rows, norm = stats
        denom = max(weight, 1e-6)
        lw = cfg.loss_weights
        per_term = {"ce": ce / denom, "tv": tv / denom, "conf": conf / denom}
        per_term = {k: v for k, v in per_term.items() if k in self.loss_terms}
        loss = (lw.ce * ce + lw.tv * tv + lw.conf * conf) / denom
        if lw.mse:
            per_term["mse"] = mse / max(mse_weight, 1e-6)
            loss += lw.mse * per_term["mse"]
        return StepStats(
            loss=loss,
            accept=accept / max(count, 1.0),
            tokens=int(tok),
            lr=lr,
            grad_norm=norm,
            per_term=per_term,
            lm_head_positions=int(lm_rows),
        )

    def _loss_chunks(self, n_rows: int, rows_per_item: int) -> list[slice]:
        """Slices of ``n_rows`` items (blocks, or MTP positions) of ``rows_per_item`` LM-head
        rows each, at most ``loss_chunk_rows`` rows a slice (0: one slice)."""
        step = n_rows if not self.cfg.loss_chunk_rows else max(
            1, self.cfg.loss_chunk_rows // rows_per_item)  # fmt: skip
        return [slice(i, i + step) for i in range(0, n_rows, max(step, 1))]

    def _target_distribution(self, target, sl: slice):
        """The target at a chunk of full blocks: logits from its final hidden state (made
        here, no gradient) or its top-k."""
        if isinstance(target, TargetTopK):
            return target[sl]
        with torch.no_grad():
            return self.target.logits(target[sl])

    def _head_sums(self, h: torch.Tensor, mb: _MicroBatch, sl: slice) -> LossSums:
        """TV / CE / CONF sums over a chunk ``sl`` of the full-loss blocks; h [B, gamma, H]."""
        idx = mb.full[sl]
        prev = mb.prev_tokens[idx]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            draft_logits = self.drafter.draft_logits(h[idx], prev)
            conf_logits = self.drafter.confidence_logits(h[idx], prev)
        return loss_sums(
            draft_logits,
            self._target_distribution(mb.target, sl),
            mb.labels[idx],
            mb.valid[idx],
            conf_logits,
            decay=self.cfg.decay,
        )

    def _block_hidden(self, mb: _MicroBatch) -> torch.Tensor:
        """h_1..h_gamma [B, gamma, H] of the micro-batch's real blocks."""
        with self._timed("drafter"), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                                     enabled=self.bf16):  # fmt: skip
            hidden = self.drafter(mb.context, mb.layout)
            return hidden.flatten(0, 1)[mb.rows]

    def _head_items(self, mb) -> tuple[int, int]:
        """(items the vocabulary terms cover, LM-head rows per item): full-loss blocks of
        gamma rows (MTP-1: supervised positions of one row)."""
        return (0 if mb.target is None else mb.full.numel()), self.draft_config.block_size

    def _mse_sums(self, h: torch.Tensor, mb: _MicroBatch) -> LossSums:
        """The dense centred-logit MSE over every block (``loss.LogitGram``)."""
        head = self.drafter.markov_head
        codes = head.block_codes(mb.prev_tokens, h)
        mse = self._gram.mse(h.float() - mb.target_hidden.float(), codes, head.markov_w2.weight)
        wv = position_weights(mse.shape[1], self.cfg.decay, mse.device) * mb.valid.float()
        sums = LossSums.zeros(self.device)
        sums.mse, sums.mse_weight = (mse * wv).sum(), wv.sum()
        return sums

    def _forward_backward(self, mb, weight_total: torch.Tensor,
                          mse_weight_total: torch.Tensor) -> LossSums:  # fmt: skip
        """The micro-batch's loss sums, with their gradient accumulated into the drafter:
        the backbone once, then the vocabulary terms a chunk at a time (each chunk's
        backward stops at the backbone's output), then one backward through the backbone.
        The loss is linear in the sums, so this is the gradient of the whole at once."""
        lw = self.cfg.loss_weights
        hidden = self._block_hidden(mb)
        h = hidden.detach().requires_grad_()
        totals = LossSums.zeros(self.device)
        with self._timed("loss"):
            for sl in self._loss_chunks(*self._head_items(mb)):
                sums = self._head_sums(h, mb, sl)
                combine(sums, lw, weight_total, mse_weight_total).backward()
                totals = totals + sums.detached()
        if getattr(mb, "target_hidden", None) is not None:
            sums = self._mse_sums(h, mb)
            combine(sums, lw, weight_total, mse_weight_total).backward()
            totals = totals + sums.detached()
        if h.grad is not None:
            with self._timed("drafter"):
                hidden.backward(h.grad)
        return totals

    def _micro_batch_loss(self, mb) -> LossSums:
        """The micro-batch's loss sums in one piece, with their graph (no backward run): the
        reference the chunked ``_forward_backward`` equals."""
        hidden = self._block_hidden(mb)
        sums = LossSums.zeros(self.device)
        if self._head_items(mb)[0]:
            sums = self._head_sums(hidden, mb, slice(None))
        if getattr(mb, "target_hidden", None) is not None:
            mse = self._mse_sums(hidden, mb)
            sums.mse, sums.mse_weight = mse.mse, mse.mse_weight
        return sums

    # -------------------------------------------------------------- held-out evaluation
    @property
    def draft_positions(self) -> int:
        """Draft tokens a verify round can accept (gamma; 1 for MTP-1)."""
        return self.draft_config.block_size

    # -------------------------------------------------------------- loop
    def train(self) -> Path:
        cfg = self.cfg
        end = self.total_steps
        if cfg.stop_after is not None:
            end = min(end, self.step + cfg.stop_after)
        bar = None
        if self.dist.main and cfg.progress and self.step < end:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc=self.kind, unit="step")
        if self.dist.main and self.step < end:
            logger.info(
                "%s: budget %d LM-head positions per step (global_batch_size %d x num_anchors "
                "%d x block_size %d)", self.kind, self.lm_head_budget, cfg.global_batch_size,
                cfg.num_anchors, cfg.block_size,
            )  # fmt: skip
        metrics = (self.out_dir / "metrics.jsonl").open("a") if self.dist.main else None
        evals = None
        if cfg.eval_data:
            evals = (self.out_dir / "eval.jsonl").open("a") if self.dist.main else None
            if self.step == 0 and self.step < end:
                self._log_eval(evals)
        t0, tokens = time.perf_counter(), 0
        boxed = signalled = False
        self.stop_signal: int | None = None
        try:
            with StopSignals() as stop:
                while self.step < end and not (boxed or signalled):
                    stats = self.train_step()
                    tokens += stats.tokens
                    elapsed = time.perf_counter() - t0
                    tok_s = tokens / max(elapsed, 1e-9)
                    boxed, signalled = self._stop_requested(elapsed, stop.signum is not None)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{stats.loss:.4f}", acc=f"{stats.accept:.3f}",
                                        tok_s=f"{tok_s:.0f}")  # fmt: skip
                    if metrics is not None:
                        rec = {"step": self.step, **dataclasses.asdict(stats), "tok_s": tok_s,
                               "elapsed_s": elapsed, "lm_head_budget": self.lm_head_budget}  # fmt: skip
                        metrics.write(json.dumps(rec) + "\n")
                        metrics.flush()
                    if (
                        cfg.eval_data
                        and not signalled
                        and (
                            (cfg.eval_every and self.step % cfg.eval_every == 0)
                            or self.step == self.total_steps
                            or boxed
                        )
                    ):
                        self._log_eval(evals)
                    if (self.step % cfg.checkpoint_every == 0 or self.step == self.total_steps
                            or boxed or signalled):  # fmt: skip
                        self.save_checkpoint()
            # a rank stopped by another rank's signal reports SIGTERM
            self.stop_signal = (stop.signum or int(signal.SIGTERM)) if signalled else None
        finally:
            if bar is not None:
                bar.close()
            for fh in (metrics, evals):
                if fh is not None:
                    fh.close()
        if signalled and self.step < self.total_steps:
            if self.dist.main:
                logger.warning("stopped by a signal at step %d of %d: checkpoint saved (rerun "
                               "with the same --out-dir to continue)", self.step, self.total_steps)  # fmt: skip
            return self.ckpt_path
        if boxed and self.step < self.total_steps:
            if self.dist.main:
                logger.warning(
                    "time limit %.0f s reached at step %d of %d: checkpoint saved, the drafter "
                    "exported as it stands (rerun with the same --out-dir to continue)",
                    cfg.time_limit_s, self.step, self.total_steps,
                )  # fmt: skip
            return self.export()
        if self.step >= self.total_steps:
            return self.export()
        # stop_after: like an interruption, steps since the last checkpoint are not saved.
        return self.ckpt_path

    def _stop_requested(self, elapsed: float, signalled: bool) -> tuple[bool, bool]:
        """(time limit reached, stop signal received), the same on every rank so that all stop
        at the same step: rank 0's clock decides the time limit; a signal to any rank stops all."""
        limit = self.cfg.time_limit_s
        boxed = self.dist.main and limit is not None and elapsed >= limit
        if self.dist.world > 1:
            flags = torch.tensor([float(boxed), float(signalled)], device=self.dist.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            boxed, signalled = bool(flags[0].item()), bool(flags[1].item())
        return boxed, signalled

    def export(self) -> Path:
        out = self.out_dir / "draft"
        if self.dist.main:
            save_draft(self.drafter, out, dtype=getattr(torch, self.cfg.export_dtype))
        if self.dist.world > 1:
            dist.barrier()
        return out


if __name__ == "__main__":
    from sglang_dspark.drafter.training.cli import main

    raise SystemExit(main())

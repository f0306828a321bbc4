"""Train a DSpark drafter (or the MTP-1 baseline, ``--drafter mtp``) against a frozen target.

    python -m sglang_dspark.drafter.train --data train.jsonl --target TARGET_DIR --out-dir RUN
    torchrun --nproc_per_node 2 -m sglang_dspark.drafter.train ...      (gloo on CPU)

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

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import (
    DraftCheckpointError,
    load_draft,
    load_training_checkpoint,
    save_draft,
)
from .config import DraftConfigError, DSparkDraftConfig, validate_draft_for_target
from .data import (
    BlockTargets,
    TokenSequence,
    _stable_seed,
    block_targets,
    load_sequences,
    sample_anchor_split,
)
from .feature_store import FeatureStore, store_key
from .loss import (
    LogitGram,
    LossSums,
    LossWeights,
    TargetTopK,
    combine,
    loss_sums,
    position_weights,
    tv_ce,
)
from .model import BlockLayout, DSparkDrafter, init_weights
from .target import TargetAdapter, TargetFeatures, load_target_config, pad_right, padded_batch

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Everything a training run depends on (configs as data: JSON <-> dataclass)."""

    data: str  # JSONL file or directory of *.jsonl
    target: str  # target model directory (Hugging Face format)
    out_dir: str
    drafter: str = "dspark"  # dspark | mtp (MTP-1 baseline; see train_mtp.py)
    # Drafter shape (ignored when init_draft is given). mtp uses block_size and num_anchors only
    # for its budget (num_anchors x block_size positions per sequence) and ignores the rest.
    block_size: int = 7  # gamma
    num_layers: int = 1
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    # DFlash baseline (the paper's Table 1): the Markov bias B_k is held at 0 (markov_w2 zeroed
    # and frozen), so drafts come from the parallel backbone alone. The export is still a valid
    # DSpark draft (SGLang requires a Markov head) and serves exactly as DFlash would.
    dflash: bool = False
    target_layer_ids: list[int] | None = None  # default: 5 spread ids, see config.py
    num_context_features: int | None = None  # m when target_layer_ids is not given
    mask_token_id: int | None = None
    init_draft: str | None = None  # start from an SGLang / DeepSpec draft directory
    # A new drafter's layer i starts from target decoder layer init_layers_from_target[i]
    # (every tensor whose name and shape agree; the rest keep their random init).
    init_layers_from_target: list[int] | None = None
    # Append this many decoder layers to the init_draft (DSpark only), each a copy of its last
    # layer with o_proj and down_proj zeroed: the grown drafter starts as exactly the loaded
    # one's function (both residual branches add 0) and the new layers learn from there.
    grow_layers: int = 0
    # Raise the init_draft's Markov rank to this (vanilla head; 0 keeps it): new W1 columns
    # random (N(0, 0.02), seeded), new W2 columns and confidence-head weights zero, so the
    # grown drafter starts as exactly the loaded function.
    grow_markov_rank: int = 0
    # Data.
    max_length: int = 2048
    num_anchors: int = 64  # anchors (blocks) per sequence
    # More blocks per sequence supervised by the dense centred-logit MSE only (no vocabulary
    # pass; see loss.py). Needs mse_weight > 0.
    dense_anchors: int = 0
    # Optimisation.
    steps: int | None = None  # default: epochs * steps_per_epoch
    epochs: int = 1
    global_batch_size: int = 8  # sequences per optimizer step, all ranks together
    micro_batch_size: int = 1  # sequences per drafter forward, per rank
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    decay: float = 4.0  # w_k = exp(-(k-1)/decay)
    mse_weight: float = 0.0  # centred-logit MSE on every block (full and dense)
    # Supervise TV/CE with the target's k most likely tokens per position (computed once per
    # sequence with its features, kept in the feature cache / store) and the rest of the
    # vocabulary as one bucket, instead of the target's full logits every step (loss.py).
    # 0 = full logits. A step then runs no target LM head and no target softmax.
    target_topk: int = 0
    # LM-head rows (blocks x gamma) per chunk of the vocabulary losses: bounds the
    # [rows, V] logits alive at once (draft, target and gradient). 0 = one chunk.
    loss_chunk_rows: int = 8192
    precision: str = "auto"  # auto (bf16 autocast where the device has bf16), bf16, fp32
    # Where the target and the drafter run: auto (the local CUDA device when torch sees one,
    # cuda:LOCAL_RANK under torchrun; else cpu), cpu, cuda or cuda:N. Data order, anchors and
    # initial weights are drawn on the CPU whatever the device.
    device: str = "auto"
    target_dtype: str = "float32"
    # Keep each sequence's target features (context + final hidden, in target_dtype) in
    # memory after its first use, so epochs after the first skip the target's forward.
    # Capped at this many GiB (0 = off); sequences beyond the cap are recomputed each time.
    # On the training device (GPU memory under CUDA). Which sequences it holds is fixed up
    # front (length-sorted groups of target_batch_size, in that order, while they fit), and
    # a cached sequence's features are computed with its group, so they do not depend on
    # the step that first needed them: a resumed run is bit-exact with an uninterrupted one.
    feature_cache_gb: float = 8.0
    # Sequences per target forward when filling the cache (one length-sorted group); the
    # sequences the cache cannot hold run in one forward per micro-batch.
    target_batch_size: int = 32
    # Directory of target features on disk shared by runs against the same target
    # (feature_store.py): later runs, epochs and ablation arms skip the target's forward.
    feature_store: str | None = None
    # Held-out evaluation: per draft position, the mean of 1 - TV/2 between the teacher-forced
    # drafter and the target on these sequences (a JSONL file or directory, like data), at step
    # 0, every eval_every steps and at the end; written to OUT/eval.jsonl. On sequences sampled
    # from the target at temperature T, position k's value is the expected acceptance of
    # draft k at T given that drafts 1..k-1 were accepted.
    eval_data: str | None = None
    eval_every: int = 0  # 0: at step 0 and at the end only
    seed: int = 0
    # Bookkeeping.
    checkpoint_every: int = 100
    resume: bool = True
    # End this invocation after N steps WITHOUT a final checkpoint, as an interruption would
    # (steps since the last checkpoint are redone on resume). For tests and time-boxed runs.
    stop_after: int | None = None
    # Wall-clock box: after the first step that ends past this many seconds, save a checkpoint
    # and export the drafter as it stands (a rerun with the same --out-dir resumes). The
    # schedule is still the one for `steps`, so a boxed drafter has not annealed.
    time_limit_s: float | None = None
    export_dtype: str = "bfloat16"
    progress: bool = True

    @classmethod
    def from_json(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        raw = json.loads(Path(path).read_text())
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise DraftConfigError(f"{path}: unknown training config keys {sorted(unknown)}")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**raw)

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(
            self.ce_weight, self.tv_weight, self.conf_weight, self.decay, self.mse_weight
        )


class StepSchedule:
    """Which sequences each step uses: a fresh permutation per epoch, drop-last batches."""

    def __init__(self, num_sequences: int, global_batch_size: int, seed: int) -> None:
        if num_sequences < global_batch_size:
            raise DraftConfigError(
                f"the dataset has {num_sequences} sequences, fewer than global_batch_size "
                f"{global_batch_size}; lower global_batch_size or add data."
            )
        self.n = num_sequences
        self.g = global_batch_size
        self.seed = seed
        self.steps_per_epoch = num_sequences // global_batch_size
        self._perm_epoch = -1
        self._perm = torch.arange(0)

    def samples(self, step: int) -> tuple[int, list[int]]:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(_stable_seed(self.seed, epoch))
            self._perm = torch.randperm(self.n, generator=gen)
            self._perm_epoch = epoch
        return epoch, self._perm[i * self.g : (i + 1) * self.g].tolist()


def warmup_cosine(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * cosine

    return factor


# ---------------------------------------------------------------------------- trainer
class PhaseTimer:
    """Seconds per phase of the steps it is attached to (``trainer.timer = PhaseTimer(dev)``):
    target (features), drafter (backbone forward and backward), loss (vocabulary terms,
    forward and backward), optimizer (reduce, clip, step). The device is synchronised at each
    boundary, which costs time of its own: for benchmarks (``benchmarks/train_step.py``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


def resolve_device(name: str) -> torch.device:
    """``TrainConfig.device`` as a torch device: auto = the local CUDA device when torch sees
    one (``LOCAL_RANK`` under torchrun), else the CPU; a bare ``cuda`` also means the local
    one. Refuses what this torch cannot run, with the fix."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise DraftConfigError(f"device {name!r} is not a device ({e}); use auto, cpu, cuda or "
                               "cuda:N") from e  # fmt: skip
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DraftConfigError(f"device {name!r}: the trainer runs on cpu or cuda; use auto, "
                               "cpu, cuda or cuda:N")  # fmt: skip
    if not torch.cuda.is_available():
        raise DraftConfigError(
            f"device {name!r}: torch {torch.__version__} sees no CUDA device here; use "
            "--device cpu (or auto, which picks the CPU when there is no GPU)"
        )
    index = dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise DraftConfigError(f"device cuda:{index}: this machine has "
                               f"{torch.cuda.device_count()} CUDA devices")  # fmt: skip
    return torch.device("cuda", index)


def to_device(obj: Any, device: torch.device) -> Any:
    """Every tensor of ``obj`` (a tensor, a dataclass of them, nested) on ``device``; other
    fields unchanged. A no-op for tensors already there (the CPU path copies nothing). CPU
    tensors go to a GPU through pinned memory, asynchronously: a copy from pageable memory
    would wait for the GPU's queued work first (a hidden sync per tensor)."""
    if isinstance(obj, torch.Tensor):
        if device.type == "cuda" and obj.device.type == "cpu":
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(t, device) for t in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        moved = {f.name: to_device(getattr(obj, f.name), device)
                 for f in dataclasses.fields(obj) if f.init}  # fmt: skip
        return dataclasses.replace(obj, **moved)
    return obj


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (through the process group's device: NCCL reduces
        CUDA tensors only)."""
        if self.world > 1:
            buf = t.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            if buf is not t:
                t.copy_(buf)
        return t


def _init_distributed(device: torch.device | None = None) -> _Dist:
    device = device or torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist(device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return _Dist(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def _use_bf16(precision: str, device: torch.device | None = None) -> bool:
    if precision == "fp32":
        return False
    if precision == "bf16":
        return True
    if precision != "auto":
        raise DraftConfigError(f"precision {precision!r} is not one of auto, bf16, fp32")
    if device is not None and device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - any failure means "no fast bf16"
        return False


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


@dataclass
class StepStats:
    loss: float
    accept: float  # mean 1 - TV/2 over supervised positions (acceptance proxy)
    tokens: int
    lr: float
    grad_norm: float
    per_term: dict[str, float] = field(default_factory=dict)
    lm_head_positions: int = 0  # budget: drafter positions through the LM head this step


DRAFTER_KINDS = ("dspark", "mtp", "dspark-v4")
# Held-out sequences are indexed _EVAL_INDEX, _EVAL_INDEX - 1, ... (their own feature cache);
# -1 stays "not from a dataset".
_EVAL_INDEX = -2


def build_trainer(cfg: TrainConfig, *, dist_ctx: _Dist | None = None) -> Trainer:
    """The trainer for ``cfg.drafter``: ``Trainer`` (DSpark), ``train_mtp.MtpTrainer`` or
    ``train_v4.V4Trainer`` (DeepSeek-V4 DSpark)."""
    if cfg.drafter == Trainer.kind:
        return Trainer(cfg, dist_ctx=dist_ctx)
    if cfg.drafter == "mtp":
        from .train_mtp import MtpTrainer

        return MtpTrainer(cfg, dist_ctx=dist_ctx)
    if cfg.drafter == "dspark-v4":
        from .train_v4 import V4Trainer

        return V4Trainer(cfg, dist_ctx=dist_ctx)
    raise DraftConfigError(
        f"drafter {cfg.drafter!r} is not one of {DRAFTER_KINDS}; pass --drafter dspark, "
        "--drafter mtp or --drafter dspark-v4."
    )


class Trainer:
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
        final = pad_right([f.final_hidden for f in feats]) if need_final or self.cfg.mse_weight else None
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
        of target_batch_size, admitted in that order while the budget holds them. A function
        of the data and the config only."""
        order = sorted(range(len(self.sequences)),
                       key=lambda i: (self.sequences[i].input_ids.numel(), i))  # fmt: skip
        budget, row = self.cfg.feature_cache_gb * 2**30, self._feature_row_bytes()
        g, used = max(1, self.cfg.target_batch_size), 0
        self._groups = []
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
            for seq, f in zip(members, self._compute_features_batch([m.input_ids for m in members])):
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
        acc, cnt = hidden.new_zeros(gamma, dtype=torch.float32), hidden.new_zeros(gamma, dtype=torch.float32)
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
        boxed = False
        try:
            while self.step < end and not boxed:
                stats = self.train_step()
                tokens += stats.tokens
                elapsed = time.perf_counter() - t0
                tok_s = tokens / max(elapsed, 1e-9)
                boxed = self._time_box_reached(elapsed)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{stats.loss:.4f}", acc=f"{stats.accept:.3f}", tok_s=f"{tok_s:.0f}"
                    )
                if metrics is not None:
                    rec = {"step": self.step, **dataclasses.asdict(stats), "tok_s": tok_s,
                           "elapsed_s": elapsed, "lm_head_budget": self.lm_head_budget}  # fmt: skip
                    metrics.write(json.dumps(rec) + "\n")
                    metrics.flush()
                if cfg.eval_data and (
                    (cfg.eval_every and self.step % cfg.eval_every == 0)
                    or self.step == self.total_steps
                    or boxed
                ):
                    self._log_eval(evals)
                if (
                    self.step % cfg.checkpoint_every == 0
                    or self.step == self.total_steps
                    or boxed
                ):
                    self.save_checkpoint()
        finally:
            if bar is not None:
                bar.close()
            for fh in (metrics, evals):
                if fh is not None:
                    fh.close()
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

    def _time_box_reached(self, elapsed: float) -> bool:
        """Every rank stops at the same step (rank 0's clock decides)."""
        if self.cfg.time_limit_s is None:
            return False
        flag = torch.tensor([float(elapsed >= self.cfg.time_limit_s)], device=self.dist.device)
        if self.dist.world > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def export(self) -> Path:
        out = self.out_dir / "draft"
        if self.dist.main:
            save_draft(self.drafter, out, dtype=getattr(torch, self.cfg.export_dtype))
        if self.dist.world > 1:
            dist.barrier()
        return out


@torch.no_grad()
def grow_drafter(
    drafter: DSparkDrafter, extra: int = 0, *, markov_rank: int = 0, seed: int = 0
) -> DSparkDrafter:
    """``drafter`` grown without changing its function:

    - ``extra`` decoder layers appended, each a copy of its last layer whose attention output
      (o_proj) and MLP output (down_proj) are zero: a residual layer that adds 0 (gradients
      reach o_proj and down_proj at once, the rest of the new layer through them);
    - a vanilla Markov head's rank raised to ``markov_rank``: the new W1 columns N(0, 0.02)
      from ``seed``, the new W2 columns and the confidence head's weights on them zero (B_k and
      c_k unchanged; W2's new columns get gradients through the random W1 ones)."""
    if not isinstance(drafter, DSparkDrafter):
        raise DraftConfigError("growing applies to DSpark drafters (SGLang Qwen3DSparkModel)")
    old = drafter.config
    rank = markov_rank or old.markov_rank
    if rank != old.markov_rank and old.markov_head_type != "vanilla":
        raise DraftConfigError(
            f"grow_markov_rank applies to the vanilla Markov head, not {old.markov_head_type!r}"
        )
    config = dataclasses.replace(
        old, num_hidden_layers=old.num_hidden_layers + extra, markov_rank=rank
    )
    grown = DSparkDrafter(config)
    state = drafter.state_dict()
    if rank != old.markov_rank:
        r0, gen = old.markov_rank, torch.Generator().manual_seed(int(seed))
        w1 = state["markov_head.markov_w1.weight"]
        new_w1 = torch.randn(w1.shape[0], rank - r0, generator=gen, dtype=torch.float32) * 0.02
        state["markov_head.markov_w1.weight"] = torch.cat([w1, new_w1.to(w1.dtype)], dim=1)
        w2 = state["markov_head.markov_w2.weight"]
        state["markov_head.markov_w2.weight"] = torch.cat([w2, w2.new_zeros(w2.shape[0], rank - r0)], 1)
        if "confidence_head.proj.weight" in state and old.confidence_head_with_markov:
            w = state["confidence_head.proj.weight"]
            state["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, rank - r0)], 1)
    missing, unexpected = grown.load_state_dict(state, strict=False)
    n = old.num_hidden_layers
    assert not unexpected and all(int(k.split(".")[1]) >= n for k in missing), missing
    last = drafter.layers[n - 1].state_dict()
    for layer in grown.layers[n:]:
        layer.load_state_dict(last)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    grown.shared = drafter.shared
    return grown


def disable_markov_bias(drafter: torch.nn.Module) -> None:
    """DFlash: B_k = W2 z_k is 0 for every head type once W2 is 0; W2 is then frozen. W1 still
    trains through the confidence head, which reads W1[x_{k-1}]."""
    head = getattr(drafter, "markov_head", None)
    if head is None:
        raise DraftConfigError("dflash applies to DSpark drafters (a Markov head to switch off)")
    with torch.no_grad():
        head.markov_w2.weight.zero_()
    head.markov_w2.weight.requires_grad_(False)


def copy_target_layers(
    drafter: torch.nn.Module, target_layers: Sequence[torch.nn.Module], ids: Sequence[int]
) -> list[str]:
    """Draft layer i <- target layer ids[i], tensor by tensor where names and shapes agree
    (a Llama target has no q_norm / k_norm: those keep their init). Returns the names copied;
    refuses a count or index that does not fit, and a layer with nothing in common."""
    layers = drafter.layers
    if len(ids) != len(layers):
        raise DraftConfigError(
            f"init_layers_from_target names {len(ids)} target layers for {len(layers)} draft "
            "layers; give one target layer index per draft layer"
        )
    copied = []
    for i, t in enumerate(ids):
        if not 0 <= int(t) < len(target_layers):
            raise DraftConfigError(
                f"init_layers_from_target: target layer {t} does not exist (the target has "
                f"{len(target_layers)} layers, 0..{len(target_layers) - 1})"
            )
        source = target_layers[int(t)].state_dict()
        own = layers[i].state_dict()
        same = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
        if not same:
            raise DraftConfigError(
                f"target layer {t} shares no tensor (name and shape) with draft layer {i}"
            )
        with torch.no_grad():
            for k, v in same.items():
                own[k].copy_(v.to(own[k].dtype))
        copied += [f"layers.{i}.{k}" for k in sorted(same)]
    logger.info("draft layers initialised from target layers %s: %d tensors", list(ids), len(copied))
    return copied


# ---------------------------------------------------------------------------- CLI
def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every TrainConfig field (``--config FILE.json`` supplies defaults)."""
    parser.add_argument("--config", default=None, help="JSON file with TrainConfig fields")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction)
        elif f.name == "drafter":
            parser.add_argument(flag, dest=f.name, choices=DRAFTER_KINDS, help="default dspark")
        elif f.name == "target_layer_ids":
            parser.add_argument(flag, dest=f.name, type=_int_list, help="e.g. 1,8,15,22,27")
        elif f.name == "init_layers_from_target":
            parser.add_argument(flag, dest=f.name, type=_int_list,
                                help="target layer per draft layer, e.g. 28,29")  # fmt: skip
        else:
            base_type = str(f.type).replace(" | None", "").replace("Optional[", "").rstrip("]")
            kind = {"int": int, "float": float}.get(base_type, str)
            parser.add_argument(flag, dest=f.name, type=kind)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    if args.config:
        return TrainConfig.from_json(args.config, **values)
    missing = [n for n in ("data", "target", "out_dir") if values[n] is None]
    if missing:
        raise DraftConfigError(
            "missing "
            + ", ".join("--" + m.replace("_", "-") for m in missing)
            + " (or give them in --config)"
        )
    return TrainConfig(**{k: v for k, v in values.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    d = _init_distributed(resolve_device(cfg.device))
    try:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        out = build_trainer(cfg, dist_ctx=d).train()
        if d.main:
            print(out)
    finally:
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Train a DSpark (or --drafter mtp: MTP-1) drafter (see module doc)."
    )
    add_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return run(args)
    except (DraftConfigError, DraftCheckpointError) as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())

"""A training run's configuration (JSON <-> dataclass), its data order and learning-rate
schedule."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sglang_dspark.drafter.config import (
    DraftConfigError,
)
from sglang_dspark.drafter.training.data import (
    _stable_seed,
)
from sglang_dspark.drafter.training.loss import (
    LossWeights,
)

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


DRAFTER_KINDS = ("dspark", "mtp", "dspark-v4")

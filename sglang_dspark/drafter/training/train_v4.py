"""The DeepSeek-V4 DSpark draft's hooks for :class:`train.Trainer` (``--drafter dspark-v4``).

    sglang-dspark train --drafter dspark-v4 --target V4_DIR --data DATA --out-dir RUN \\
        [--target-layer-ids 1,2,3] [--block-size 5] [--markov-rank 32] [--init-draft V4_DIR]

Everything but the drafter and the target's capture is the DSpark trainer's: data, anchors
and block targets, anchor-bounded packing (``BlockLayout``), the loss (0.1 CE + 0.9 TV +
1.0 BCE(confidence), w_k = exp(-(k-1)/decay); ``loss.py``), schedule, optimiser, checkpoints
and resume, feature cache / store, torchrun, metrics. Specific to V4:

- target: :class:`target_v4.V4TargetAdapter` (stream means of the outputs of
  ``target_layer_ids``, float32), the final hidden state and LM head for p_t;
- drafter: :class:`dspark_v4.DSparkV4Drafter`, one stage per target layer id (SGLang builds
  ``len(dspark_target_layer_ids)`` stages; ``--num-layers`` does not apply), initialised as
  transformers initialises DeepSeek-V4 (``--init-draft`` starts from a V4 checkpoint's
  bundled draft instead, ``--init-layers-from-target`` copies target layers by name/shape);
- export: ``OUT/draft``, a V4 draft directory (``checkpoint_v4.save_v4_draft``); bundle it
  into a target copy with ``checkpoint_v4.bundle_v4_draft``.

Defaults for unset draft fields come from the target's bundled ``dspark_*`` keys when it has
them (layer ids, mask token, the draft MoE's expert counts); ``--block-size`` and
``--markov-rank`` are the trainer's (7 and 256 unless given).
Not available here: the dense MSE term (``--mse-weight`` / ``--dense-anchors``), whose
target is the post-norm hidden state while V4's draft hidden is the pre-norm x_post_hc.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.dspark_v4 import DSparkV4Drafter, V4DraftConfig, init_v4_weights
from sglang_dspark.drafter.formats.checkpoint_v4 import load_v4_draft, save_v4_draft
from sglang_dspark.drafter.training.feature_store import FeatureStore, store_key
from sglang_dspark.drafter.training.growth import copy_target_layers, disable_markov_bias
from sglang_dspark.drafter.training.target_v4 import V4TargetAdapter
from sglang_dspark.drafter.training.train import Trainer

logger = logging.getLogger(__name__)


class V4Trainer(Trainer):
    kind = "dspark-v4"

    def __init__(self, cfg, *, dist_ctx=None) -> None:
        # The base constructor loads the target through the dense adapter, whose layer-id
        # check refuses a V4 target's last layer (a valid V4 capture); it captures nothing
        # here (placeholder id 0), and the V4 adapter takes the loaded model over below.
        self._placeholder_ids = True
        super().__init__(cfg, dist_ctx=dist_ctx)
        self._placeholder_ids = False
        self.target = V4TargetAdapter(self.target.model, self.draft_config.target_layer_ids)
        if cfg.feature_store:
            kind = type(self).__name__ + (f"+top{cfg.target_topk}" if cfg.target_topk else "")
            key = store_key(cfg.target, cfg.target_dtype, self._target_layer_ids(), kind)
            self._store = FeatureStore(cfg.feature_store, key)

    # -------------------------------------------------------------- setup
    def _check_loss_options(self) -> None:
        cfg = self.cfg
        if cfg.drafter != self.kind:
            raise DraftConfigError(f"V4Trainer needs drafter='dspark-v4', got {cfg.drafter!r}")
        if cfg.mse_weight or cfg.dense_anchors:
            raise DraftConfigError(
                "mse_weight / dense_anchors are not available with --drafter dspark-v4 (the "
                "MSE target is a post-norm hidden state; V4's draft hidden is pre-norm); set "
                "them to 0."
            )
        if cfg.grow_layers or cfg.grow_markov_rank:
            raise DraftConfigError(
                "grow_layers / grow_markov_rank are not available with --drafter dspark-v4 (a V4 draft has one "
                "stage per target layer id); drop it."
            )
        super()._check_loss_options()

    def _draft_config(self, target_config: dict) -> V4DraftConfig:
        cfg = self.cfg
        if cfg.init_draft:
            import json

            path = Path(cfg.init_draft) / "config.json"
            if not path.is_file():
                raise DraftConfigError(f"{path} does not exist; --init-draft takes a V4 "
                                       "checkpoint directory with a DSpark draft.")  # fmt: skip
            return V4DraftConfig.from_config_json(json.loads(path.read_text()))
        if cfg.markov_head_type != "vanilla":
            raise DraftConfigError(
                f"markov_head_type {cfg.markov_head_type!r}: SGLang's V4 DSpark draft has the "
                "vanilla Markov head only; drop --markov-head-type."
            )
        if cfg.num_layers not in (1, len(cfg.target_layer_ids or [])):
            logger.warning("--num-layers %d ignored: a V4 draft has one stage per target layer "
                           "id", cfg.num_layers)  # fmt: skip
        return V4DraftConfig.for_target(
            target_config,
            target_layer_ids=cfg.target_layer_ids,
            block_size=cfg.block_size,
            markov_rank=cfg.markov_rank,
            mask_token_id=cfg.mask_token_id,
            num_context_features=cfg.num_context_features,
        )

    def _draft_problems(self, target_config: dict) -> list[str]:
        out = self.draft_config.problems()
        mine = self.draft_config.target
        for key in ("hidden_size", "vocab_size", "num_hidden_layers", "hc_mult", "head_dim"):
            if mine.get(key) != target_config.get(key):
                out.append(
                    f"the draft was made for a target with {key}={mine.get(key)}, this target "
                    f"has {target_config.get(key)}."
                )
        return out

    def _target_layer_ids(self) -> list[int]:
        if getattr(self, "_placeholder_ids", False):
            return [0]
        return list(self.draft_config.target_layer_ids)

    def _build_drafter(self) -> torch.nn.Module:
        cfg = self.cfg
        if cfg.init_draft:
            drafter = load_v4_draft(cfg.init_draft)
        else:
            drafter = DSparkV4Drafter(self.draft_config)
            init_v4_weights(drafter, seed=cfg.seed)
            if cfg.init_layers_from_target:
                copy_target_layers(drafter, self.target.layers, cfg.init_layers_from_target)
        if cfg.dflash:
            disable_markov_bias(drafter)
        drafter = drafter.float().to(self.device)
        if self.dist.world > 1:  # identical start on every rank
            for t in drafter.state_dict().values():
                dist.broadcast(t, src=0)
        return drafter.train()

    # -------------------------------------------------------------- export
    def export(self) -> Path:
        out = self.out_dir / "draft"
        if self.dist.main:
            save_v4_draft(self.drafter, out)
        if self.dist.world > 1:
            dist.barrier()
        return out

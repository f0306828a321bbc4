"""Which trainer trains which drafter kind: by name, resolved when asked (the base trainer
module imports none of its subclasses)."""

from __future__ import annotations

import pkgutil

from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.training.config import DRAFTER_KINDS, TrainConfig

TRAINERS = {
    "dspark": "sglang_dspark.drafter.training.train:Trainer",
    "mtp": "sglang_dspark.drafter.training.train_mtp:MtpTrainer",
    "dspark-v4": "sglang_dspark.drafter.training.train_v4:V4Trainer",
}


def build_trainer(cfg: TrainConfig, *, dist_ctx=None):
    """The trainer for ``cfg.drafter``: DSpark, the MTP-1 baseline or DeepSeek-V4 DSpark."""
    path = TRAINERS.get(cfg.drafter)
    if path is None:
        raise DraftConfigError(
            f"drafter {cfg.drafter!r} is not one of {DRAFTER_KINDS}; pass --drafter dspark, "
            "--drafter mtp or --drafter dspark-v4."
        )
    return pkgutil.resolve_name(path)(cfg, dist_ctx=dist_ctx)

"""`sglang-dspark train` / `python -m sglang_dspark.drafter.training.train`: arguments to a
`TrainConfig`, the trainer for its drafter kind, the run."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist

from sglang_dspark.drafter.config import (
    DraftConfigError,
)
from sglang_dspark.drafter.formats.checkpoint import (
    DraftCheckpointError,
)
from sglang_dspark.drafter.training.config import DRAFTER_KINDS, TrainConfig
from sglang_dspark.drafter.training.registry import build_trainer
from sglang_dspark.drafter.training.runtime import _init_distributed, resolve_device

logger = logging.getLogger(__name__)


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
        trainer = build_trainer(cfg, dist_ctx=d)
        out = trainer.train()
        if d.main:
            print(out)
        if trainer.stop_signal is not None:  # stopped early by SIGTERM/SIGINT, checkpoint saved
            return 128 + trainer.stop_signal
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

"""Target features on disk, shared by training runs against the same frozen target.

The target's forward over a sequence is most of a first-epoch training step on a CPU, and its
result depends only on the target, its dtype, what is captured and the tokens. Paired
ablations (same data, one drafter change each) therefore compute the same features once per
arm; with a store (`--feature-store DIR`) the first run writes them and every later run,
epoch or arm reads them back.

Layout: `DIR/<key>/<sha256 of the token ids>.safetensors` holding `context` and
`final_hidden` (and `topk_ids` / `topk_logp` when the trainer supervises with the target's
top-k: the kind then names k). `<key>` hashes everything the features depend on: the target's resolved path,
its config.json, the sizes and mtimes of its weight files, the dtype, the capture list and the
feature kind (a DSpark trainer's layer outputs, or the MTP trainer's final hidden state only).
Files are written to a temporary name and renamed, so a killed run leaves no half file; an
unreadable file is recomputed and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sglang_dspark.drafter.training.target import TargetFeatures

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def store_key(target_dir: str | Path, dtype: str, capture: Sequence[int], kind: str) -> str:
    """Everything a sequence's features depend on besides its tokens, hashed."""
    path = Path(target_dir).resolve()
    weights = sorted(
        (p.name, p.stat().st_size, int(p.stat().st_mtime))
        for p in path.iterdir()
        if p.suffix in WEIGHT_SUFFIXES
    )
    raw = {
        "target": str(path),
        "config": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
        "weights": weights,
        "dtype": dtype,
        "capture": [int(x) for x in capture],
        "kind": kind,
    }
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


class FeatureStore:
    """`get(input_ids, compute)`: the stored features of these tokens, else `compute`'s."""

    def __init__(self, root: str | Path, key: str) -> None:
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def path(self, input_ids: torch.Tensor) -> Path:
        ids = input_ids.to(torch.int64).contiguous().numpy().tobytes()
        return self.dir / f"{hashlib.sha256(ids).hexdigest()}.safetensors"

    def load(self, input_ids: torch.Tensor) -> TargetFeatures | None:
        """The stored features of these tokens (on the CPU), or None (absent or unreadable)."""
        path = self.path(input_ids)
        if path.is_file():
            try:
                t = load_file(str(path))
                feats = TargetFeatures(
                    t["context"], t["final_hidden"], t.get("topk_ids"), t.get("topk_logp")
                )
                if feats.final_hidden.shape[0] == input_ids.numel():
                    self.hits += 1
                    return feats
            except (SafetensorError, KeyError, OSError) as e:
                logger.warning("feature store: %s is unreadable (%s); recomputing it", path, e)
        self.misses += 1
        return None

    def save(self, input_ids: torch.Tensor, feats: TargetFeatures) -> None:
        path = self.path(input_ids)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous().cpu() for k, v in feats.tensors().items()}, str(tmp))
        os.replace(tmp, path)

    def get(
        self, input_ids: torch.Tensor, compute: Callable[[torch.Tensor], TargetFeatures]
    ) -> TargetFeatures:
        """The stored features of these tokens, else ``compute``'s (then stored)."""
        feats = self.load(input_ids)
        if feats is None:
            feats = compute(input_ids)
            self.save(input_ids, feats)
        return feats

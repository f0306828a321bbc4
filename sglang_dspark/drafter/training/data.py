"""Training data for the drafters: token sequences, anchors, and each block's targets.

Format (JSONL, one sequence per line; gzipped .jsonl.gz too; a directory of such files also
works):

    {"input_ids": [int, ...], "loss_mask": [0|1, ...]}

``input_ids`` is prompt + response as the target tokenizes it; ``loss_mask`` (same length,
optional: all ones when absent) is 1 on response tokens. A block's anchor a is placed where
loss_mask[a] and loss_mask[a+1] are 1, and block position k is supervised while
loss_mask[a+k] stays 1. ``{"prompt_ids": [...], "response_ids": [...]}`` is accepted too.

Anchors are functions of (seed, epoch, sample index) only (``_stable_seed``), so a resumed
run replays exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_dspark.drafter.config import DraftConfigError


@dataclass
class TokenSequence:
    input_ids: torch.Tensor  # [S] long
    loss_mask: torch.Tensor  # [S] bool
    index: int = -1  # position in the dataset (feature-cache key)


def load_sequences(path: str | Path, *, max_length: int) -> list[TokenSequence]:
    """Read the JSONL format described in the module docstring."""
    path = Path(path)
    if path.is_dir():
        files = sorted([*path.glob("*.jsonl"), *path.glob("*.jsonl.gz")])
    else:
        files = [path]
    if not files or not all(f.is_file() for f in files):
        raise DraftConfigError(
            f"no training data at {path}; pass a JSONL file (.jsonl or .jsonl.gz) or a "
            "directory of them."
        )
    out: list[TokenSequence] = []
    for f in files:
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{f}:{lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DraftConfigError(f"{where}: not JSON ({e})") from e
                if "input_ids" in rec:
                    ids = rec["input_ids"]
                    mask = rec.get("loss_mask") or [1] * len(ids)
                elif "prompt_ids" in rec and "response_ids" in rec:
                    ids = list(rec["prompt_ids"]) + list(rec["response_ids"])
                    mask = [0] * len(rec["prompt_ids"]) + [1] * len(rec["response_ids"])
                else:
                    raise DraftConfigError(
                        f"{where}: expected {{'input_ids': [...], 'loss_mask': [...]}} "
                        "(or prompt_ids + response_ids)"
                    )
                if len(mask) != len(ids):
                    raise DraftConfigError(
                        f"{where}: loss_mask has {len(mask)} entries for {len(ids)} input_ids"
                    )
                ids, mask = ids[:max_length], mask[:max_length]
                if len(ids) < 2:
                    continue
                out.append(
                    TokenSequence(
                        torch.tensor(ids, dtype=torch.long),
                        torch.tensor(mask, dtype=torch.bool),
                        index=len(out),
                    )
                )
    if not out:
        raise DraftConfigError(f"{path} holds no sequence of 2 or more tokens.")
    return out


def _stable_seed(*parts: int) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with loss_mask[a] and loss_mask[a+1]: the anchor is a response token
    (in serving: the target's bonus token) and the block's first target is one too."""
    ok = loss_mask[:-1] & loss_mask[1:]
    return ok.nonzero().squeeze(-1)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, seed: int) -> torch.Tensor:
    return sample_anchor_split(loss_mask, num_anchors, 0, seed)[0]


def sample_anchor_split(
    loss_mask: torch.Tensor, num_full: int, num_dense: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct anchors: ``num_full`` for the full loss, then up to ``num_dense`` more for the
    dense MSE term only (each set sorted). The full set does not depend on ``num_dense``."""
    cand = anchor_candidates(loss_mask)
    if cand.numel() == 0:
        return cand, cand
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cand.numel(), generator=gen)
    full = cand[perm[:num_full]].sort().values
    dense = cand[perm[num_full : num_full + num_dense]].sort().values
    return full, dense


@dataclass
class BlockTargets:
    """Per-sequence supervision for its blocks (all [B, gamma] unless noted)."""

    anchors: torch.Tensor  # [B]
    labels: torch.Tensor  # x_{a+k}
    prev_tokens: torch.Tensor  # x_{a+k-1}: teacher-forced Markov / confidence input
    valid: torch.Tensor  # supervised positions (contiguous prefix of each block)
    target_pos: torch.Tensor  # position whose target hidden state predicts x_{a+k}


def block_targets(seq: TokenSequence, anchors: torch.Tensor, block_size: int) -> BlockTargets:
    S = seq.input_ids.numel()
    k = torch.arange(1, block_size + 1)
    label_pos = anchors[:, None] + k  # a+1 .. a+gamma
    in_range = label_pos < S
    safe = label_pos.clamp(max=S - 1)
    valid = (in_range & seq.loss_mask[safe]).int().cumprod(dim=-1).bool()
    return BlockTargets(
        anchors=anchors,
        labels=seq.input_ids[safe],
        prev_tokens=seq.input_ids[(label_pos - 1).clamp(max=S - 1)],
        valid=valid,
        target_pos=safe - 1,
    )

"""STS data: per-block confidence logits, outcomes and verify windows, from either source."""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StsData:
    """Per-block confidence logits and verification outcomes, each [N, gamma]."""

    logits: torch.Tensor  # float64 raw confidence-head logits (before any temperature)
    accepted: torch.Tensor  # bool, meaningful where valid
    valid: torch.Tensor  # bool: position verified with every earlier position accepted
    verified: torch.Tensor | None = None  # [N] int64 drafts in the verify window; None: gamma
    source: str = ""

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape) for t in (self.logits, self.accepted, self.valid)}
        if len(shapes) != 1 or self.logits.dim() != 2:
            raise ValueError(
                "STS data needs logits, accepted and valid of one shape [N, gamma], got "
                f"{[tuple(t.shape) for t in (self.logits, self.accepted, self.valid)]}"
                + (f" in {self.source}" if self.source else "")
            )
        if not bool(torch.isfinite(self.logits).all()):
            raise ValueError(f"STS logits contain NaN or inf{self._where()}")
        ok_before = self.valid[:, :-1] & self.accepted[:, :-1]
        if bool((self.valid[:, 1:] & ~ok_before).any()):
            raise ValueError(
                "STS data marks a position valid although an earlier position was rejected or "
                f"not verified{self._where()}; valid[n, k] must imply valid and accepted at "
                "k-1 (a position is labelled only when all earlier drafts were accepted)"
            )
        window = self.window_mask()
        if bool((self.valid & ~window).any()):
            raise ValueError(
                f"STS data marks a position valid beyond its block's `verified` "
                f"count{self._where()}"
            )
        reachable = torch.ones_like(self.valid)
        reachable[:, 1:] = ok_before
        if bool((reachable & window & ~self.valid).any()):
            hint = (
                "pass `verified` (drafts in each block's verify window)"
                if self.verified is None
                else "fix `valid` or `verified`"
            )
            raise ValueError(
                "STS data has positions that were reachable (every earlier draft accepted) but "
                f"are not marked valid{self._where()}: the blocks were verified only partly; "
                + hint
            )

    def _where(self) -> str:
        return f" ({self.source})" if self.source else ""

    @property
    def num_samples(self) -> int:
        return int(self.logits.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])

    def window_mask(self) -> torch.Tensor:
        """[N, gamma] bool: position k lies inside the block's verify window."""
        if self.verified is None:
            return torch.ones_like(self.valid)
        return torch.arange(self.gamma)[None, :] < self.verified.to(torch.int64)[:, None]

    def cumulative_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(label, used), [N, gamma]: label = drafts 1..k all accepted; used = the window
        covered k (chosen before the outcome, so these rows are an unbiased sample)."""
        ok = self.valid & self.accepted
        label = torch.cumprod(ok.to(torch.int64), dim=1).bool()
        return label, self.window_mask()

    def rows(self, index: torch.Tensor) -> StsData:
        verified = None if self.verified is None else self.verified[index]
        return StsData(
            self.logits[index], self.accepted[index], self.valid[index], verified, self.source
        )

    def split(self, heldout_fraction: float, seed: int = 0) -> tuple[StsData, StsData | None]:
        """Random row split into (fit, held-out); held-out is None for fraction 0."""
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout fraction must be in [0, 1), got {heldout_fraction}")
        n_held = round(self.num_samples * heldout_fraction)
        if n_held == 0:
            return self, None
        perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(seed))
        return self.rows(perm[n_held:]), self.rows(perm[:n_held])

    @staticmethod
    def concat(parts: Sequence[StsData], source: str = "") -> StsData:
        gammas = {p.gamma for p in parts}
        if len(gammas) != 1:
            raise ValueError(
                "STS data files disagree on gamma: "
                + ", ".join(f"{p.source or '?'}: {p.gamma}" for p in parts)
                + "; calibrate each block size separately"
            )
        verified = None
        if any(p.verified is not None for p in parts):
            verified = torch.cat(
                [
                    p.verified
                    if p.verified is not None
                    else torch.full((p.num_samples,), p.gamma, dtype=torch.int64)
                    for p in parts
                ]
            )
        return StsData(
            torch.cat([p.logits for p in parts]),
            torch.cat([p.accepted for p in parts]),
            torch.cat([p.valid for p in parts]),
            verified,
            source,
        )


def _as_data(logits, accepted, valid, verified, source: str) -> StsData:
    return StsData(
        torch.as_tensor(np.asarray(logits), dtype=torch.float64),
        torch.as_tensor(np.asarray(accepted)).bool(),
        torch.as_tensor(np.asarray(valid)).bool(),
        None if verified is None else torch.as_tensor(np.asarray(verified)).to(torch.int64),
        source,
    )


def save_sts_data(path: str | Path, logits, accepted, valid, verified=None) -> None:
    """Write the evaluator's STS data: `.npz` (arrays) or `.json` (nested lists).

    logits [N, gamma] raw confidence logits; accepted, valid [N, gamma] 0/1; verified [N]
    drafts in each block's verify window, only needed when verification was truncated
    (see `StsData`).
    """
    data = _as_data(logits, accepted, valid, verified, str(path))  # validates before writing
    arrays = {
        "logits": data.logits.numpy(),
        "accepted": data.accepted.numpy().astype(np.uint8),
        "valid": data.valid.numpy().astype(np.uint8),
    }
    if data.verified is not None:
        arrays["verified"] = data.verified.numpy()
    path = Path(path)
    if path.suffix == ".npz":
        with path.open("wb") as f:
            np.savez_compressed(f, **arrays)
    elif path.suffix == ".json":
        path.write_text(json.dumps({k: v.tolist() for k, v in arrays.items()}), encoding="utf-8")
    else:
        raise ValueError(f"STS data path {path} must end in .npz or .json")


def load_collector_shard(path: str | Path) -> StsData:
    """One shard of SGLang's collector (`SGLANG_DSPARK_STS_COLLECT_PATH`), as `StsData`.

    Upstream's collector labels a block by its count of accepted drafts (greedy match against
    the target's argmax), so every position up to the first rejection is valid. It does not
    record the verify window: in compact mode unverified drafts look rejected (an SGLang fault).
    The plugin's recorder (`sglang_dspark.plugin.sts_collect`) writes the same dict plus
    `verified` [n] (drafts in each block's verify window) and labels by the real verification
    outcome; positions past the window are then left out.
    """
    shard = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(shard, dict) or not {"logits", "prefix_mask"} <= set(shard):
        raise ValueError(
            f"{path} is not an SGLang STS collector shard (expected a dict with 'logits' and "
            "'prefix_mask' tensors, as written by StsDataRecorder)"
        )
    prefix = shard["prefix_mask"].bool()
    valid = torch.ones_like(prefix)
    valid[:, 1:] = prefix[:, :-1]
    verified = shard.get("verified")
    if verified is not None:
        verified = verified.to(torch.int64)
        valid &= torch.arange(prefix.shape[1])[None, :] < verified[:, None]
    return StsData(shard["logits"].to(torch.float64), prefix, valid, verified, source=str(path))


def load_sts_data(path: str | Path) -> StsData:
    """Read one file: .npz / .json from our evaluator, or .pt from SGLang's collector."""
    path = Path(path)
    if path.suffix == ".pt":
        return load_collector_shard(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    elif path.suffix == ".json":
        arrays = json.loads(path.read_text(encoding="utf-8"))
    else:
        raise ValueError(
            f"don't know how to read STS data from {path}: expected .npz/.json (offline "
            "evaluator) or .pt (SGLang collector shard)"
        )
    missing = {"logits", "accepted", "valid"} - set(arrays)
    if missing:
        raise ValueError(
            f"{path} lacks the arrays {sorted(missing)} (need logits, accepted, "
            "valid, each [N, gamma])"
        )
    return _as_data(
        arrays["logits"], arrays["accepted"], arrays["valid"], arrays.get("verified"), str(path)
    )


def load_data(specs: str | Sequence[str]) -> StsData:
    """Files or globs (e.g. 'stem.*.pt'), concatenated in sorted order."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    paths: list[str] = []
    for spec in specs:
        matched = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matched:
            raise FileNotFoundError(f"no STS data file matches {spec!r}")
        paths += matched
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"STS data file {p} does not exist")
    return StsData.concat([load_sts_data(p) for p in paths], source=",".join(specs))

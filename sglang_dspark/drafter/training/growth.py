"""Function-preserving changes to a drafter before training: grown layers, Markov rank, layers
copied from the target, the Markov bias switched off."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from sglang_dspark.drafter.config import (
    DraftConfigError,
)
from sglang_dspark.drafter.model import DSparkDrafter

logger = logging.getLogger(__name__)


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
        state["markov_head.markov_w2.weight"] = torch.cat(
            [w2, w2.new_zeros(w2.shape[0], rank - r0)], 1
        )
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
    logger.info(
        "draft layers initialised from target layers %s: %d tensors", list(ids), len(copied)
    )
    return copied

"""DeepSeek-V4 target adapter: the features SGLang 0.5.23 feeds a V4 DSpark draft.

Capture point (``srt/models/deepseek_v4.py``, ``DeepseekV4Model.forward``, the V4 path
without ``hc_pre_from_prev_sublayer``): after decoder layer ``i`` has run, for every ``i`` in
``dspark_target_layer_ids`` (``set_dspark_layers_to_capture`` takes the ids as they are, no
+1 shift as for dense targets), SGLang takes the layer's completed mHC residual streams
[T, hc_mult, H] (``hc_boundary.materialize`` on CUDA, ``hc_post`` of the fused path
elsewhere) and reduces them with ``mhc_stream_mean``: the plain mean over the ``hc_mult``
streams. The m reduced states are concatenated in layer order (``pack_aux_hidden_states``):
[H(l_1); ...; H(l_m)], [T, m*H]. So a V4 id names the layer whose OUTPUT is read, and the last
layer (L - 1) is a valid id.

In transformers' ``DeepseekV4Model`` that is the output of ``model.layers[i]`` ([B, S,
hc_mult, H]) averaged over dim 2. The final hidden state (LM-head input) is the model's
``last_hidden_state`` = ``norm(hc_head(streams))``, as SGLang's target computes it.

Load the target in float32: transformers 5.19's V4 forward fails in bf16 (float32-kept norms
feed bf16 linears; ``docs/deepseek-v4.md``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.training.target import TargetAdapter, TargetFeatures


def v4_layer_id_problems(target_layer_ids: Sequence[int], num_layers: int) -> list[str]:
    ids = [int(x) for x in target_layer_ids]
    if not ids:
        return ["target_layer_ids is empty; list at least one target layer."]
    out = [
        f"target_layer_id {i} is outside 0..{num_layers - 1} for this {num_layers}-layer "
        "DeepSeek-V4 target." for i in ids if not 0 <= i < num_layers
    ]  # fmt: skip
    if any(b <= a for a, b in itertools.pairwise(ids)):
        out.append(f"target_layer_ids {ids} must be strictly increasing.")
    return out


class V4TargetAdapter(TargetAdapter):
    """Wraps transformers' ``DeepseekV4ForCausalLM`` (float32)."""

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        if getattr(self.config, "model_type", None) != "deepseek_v4":
            raise DraftConfigError(
                f"{type(model).__name__} is not a DeepSeek-V4 model; V4TargetAdapter reads "
                "DeepseekV4ForCausalLM's mHC streams."
            )
        self.base = model.model
        self.layers = self.base.layers
        self.num_layers = len(self.layers)
        problems = v4_layer_id_problems(target_layer_ids, self.num_layers)
        if problems:
            raise DraftConfigError("; ".join(problems))
        self.target_layer_ids = [int(x) for x in target_layer_ids]

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> TargetFeatures:
        """input_ids [S] or [B, S] -> context [.., S, m*H] (stream means of the captured
        layers' outputs), final [.., S, H]."""
        squeeze = input_ids.dim() == 1
        ids = input_ids[None] if squeeze else input_ids
        captured: dict[int, torch.Tensor] = {}

        def hook(idx: int):
            def fn(_module, _inputs, output):
                streams = output[0] if isinstance(output, tuple) else output  # [B, S, hc, H]
                captured[idx] = streams.mean(dim=2)  # mhc_stream_mean

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.target_layer_ids]
        try:
            out = self.base(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        context = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        final = out.last_hidden_state
        if squeeze:
            return TargetFeatures(context[0], final[0])
        return TargetFeatures(context, final)

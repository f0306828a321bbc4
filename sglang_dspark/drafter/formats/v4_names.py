"""DeepSeek-V4 tensor names: transformers' `DeepseekV4` state dict <-> DeepSeek's checkpoint
names (what SGLang loads), the bundled draft's stage names, and each tensor's storage dtype.
Shared by the tiny V4 builder (`sglang_dspark.v4.tiny`) and the V4 draft format
(`checkpoint_v4`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

# transformers' name inside a decoder layer -> DeepSeek's. The inverse of transformers'
# `deepseek_v4` conversion mapping (conversion_mapping.py), written out because that mapping
# is not one-to-one when reversed (`.norm.` -> `.kv_norm.` also matches attention's kv_norm,
# which DeepSeek, and so SGLang, call `attn.kv_norm`).
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def to_deepseek_names(hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' DeepseekV4 state dict under DeepSeek's names. The fused expert tensors
    are split per expert: ``gate_up_proj`` [E, 2I, H] -> ``w1`` (gate) / ``w3`` (up),
    ``down_proj`` [E, H, I] -> ``w2``. An unknown name is an error, not a silent drop."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = t
            continue
        if not name.startswith("model.layers."):
            raise KeyError(f"no DeepSeek name for transformers tensor {name!r}")
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        prefix = f"layers.{layer}."
        if rest == "mlp.experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = gate[e]
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = up[e]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w2.weight"] = t[e]
        elif rest in _LAYER_NAMES:
            out[prefix + _LAYER_NAMES[rest]] = t
        else:
            raise KeyError(f"no DeepSeek name for transformers tensor {name!r}")
    return out


def to_draft_stage_names(
    hf_state: Mapping[str, torch.Tensor], last: int
) -> dict[str, torch.Tensor]:
    """transformers' DeepseekV4 stage tensors under the bundled draft's names: stage `i`'s layer
    ``layers.{i}.…`` becomes ``mtp.{i}.…``, and the final norm and mHC head go to the last
    stage, ``mtp.{last}.…`` (what SGLang's DSpark remapping expects)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in to_deepseek_names(hf_state).items():
        if name.startswith("layers."):
            stage, rest = name.removeprefix("layers.").split(".", 1)
            out[f"mtp.{stage}.{rest}"] = t
        else:  # final norm, mHC head
            out[f"mtp.{last}.{name}"] = t
    return out


def from_deepseek_names(ds_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_deepseek_names`: DeepSeek's names (``layers.{i}.…``, the top
    names) back to transformers' (``model.layers.{i}.…``), per-expert ``w1`` / ``w3`` / ``w2``
    stacked into ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]. An unknown name is
    an error."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in ds_state.items():
        if name in top:
            out[top[name]] = t
            continue
        if not name.startswith("layers."):
            raise KeyError(f"no transformers name for DeepSeek tensor {name!r}")
        layer, rest = name.removeprefix("layers.").split(".", 1)
        if rest.startswith("ffn.experts."):
            e, kind = rest.removeprefix("ffn.experts.").split(".", 1)
            experts.setdefault((layer, kind), {})[int(e)] = t
        elif rest in layer_names:
            out[f"model.layers.{layer}.{layer_names[rest]}"] = t
        else:
            raise KeyError(f"no transformers name for DeepSeek tensor {name!r}")
    for layer in sorted({layer for layer, _ in experts}):
        stack = {}
        for kind in ("w1.weight", "w2.weight", "w3.weight"):
            got = experts.get((layer, kind), {})
            if sorted(got) != list(range(len(got))) or not got:
                raise KeyError(f"layers.{layer}.ffn.experts.*.{kind}: experts {sorted(got)}")
            stack[kind] = torch.stack([got[e] for e in range(len(got))])
        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj"] = torch.cat([stack["w1.weight"], stack["w3.weight"]], dim=1)
        out[prefix + "down_proj"] = stack["w2.weight"]
    return out


def storage_dtype(name: str) -> torch.dtype:
    """The dtype a tensor is stored in: the one SGLang's parameter has (bf16 model dtype)."""
    if name.endswith(".tid2eid"):
        return torch.int32
    leaf = name.rsplit(".", 1)[-1]
    if (
        leaf.startswith(("hc_attn_", "hc_ffn_", "hc_head_"))
        or leaf in ("attn_sink", "ape")
        or name.endswith(("compressor.norm.weight", "gate.bias"))
        or ".confidence_head." in name
    ):
        return torch.float32
    return torch.bfloat16

"""Target adapters: the frozen target's context features, final hidden state and LM head.

Layer-id convention (SGLang 0.5.23, ``srt/models/llama.py`` / ``qwen3.py``,
``set_dflash_layers_to_capture``): a target layer id ``l`` is an HF *layer-output* id.
SGLang captures it "before layer l + 1", i.e. the residual stream entering decoder layer
l + 1, which is the output of decoder layer l (``output_hidden_states[l + 1]`` in HF terms).
The m captured states are concatenated in layer order: [H(l_1); ...; H(l_m)].
The last layer (l = L - 1) cannot be captured; see ``config.layer_id_problems``.

"Hidden-state communication": the adapter returns the target's final (normed) hidden state
per token, O(H), and the LM head is applied later only at the block positions a loss needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sglang_dspark.drafter.config import DraftConfigError, layer_id_problems

logger = logging.getLogger(__name__)


def sglang_capture_points(target_layer_ids: Sequence[int]) -> list[int]:
    """Decoder-layer indices SGLang hooks for these ids: it captures the INPUT of l + 1."""
    return [int(l) + 1 for l in target_layer_ids]


@dataclass
class TargetFeatures:
    """context [S, m*H]: [H(l_1); ...; H(l_m)] per token; final_hidden [S, H]: after the
    target's final norm (the LM head input)."""

    context: torch.Tensor
    final_hidden: torch.Tensor
    # The target's top-k ids [S, k] and log-probabilities [S, k] at every position, when the
    # trainer supervises with them (TrainConfig.target_topk); None otherwise.
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (what the feature store writes and the cache counts)."""
        out = {"context": self.context, "final_hidden": self.final_hidden}
        if self.topk_ids is not None:
            out["topk_ids"], out["topk_logp"] = self.topk_ids, self.topk_logp
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def clone(self) -> TargetFeatures:
        return TargetFeatures(**{k: v.clone() for k, v in self.tensors().items()})


class TargetAdapter:
    """Wraps a transformers decoder-only causal LM (Llama/SmolLM2, Qwen2/3, Mistral, ...).

    Requires the usual layout: ``model.model.layers`` (decoder layers), ``model.model``
    returning the final normed hidden state, ``get_input_embeddings()`` and ``lm_head``.
    """

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if base is None or layers is None or model.get_output_embeddings() is None:
            raise DraftConfigError(
                f"{type(model).__name__} is not a supported target: expected a decoder-only "
                "causal LM with model.layers and an lm_head (Llama, Qwen2/3, Mistral, ...)."
            )
        self.base = base
        self.layers = layers
        self.num_layers = len(layers)
        problems = layer_id_problems(target_layer_ids, self.num_layers)
        if problems:
            raise DraftConfigError("; ".join(problems))
        self.target_layer_ids = [int(x) for x in target_layer_ids]

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | Path,
        target_layer_ids: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
    ) -> TargetAdapter:
        from transformers import AutoModelForCausalLM

        path = Path(target_dir)
        if not (path / "config.json").is_file():
            raise DraftConfigError(
                f"{path} is not a Hugging Face model directory (no config.json); pass the "
                "target model directory (config.json + *.safetensors)."
            )
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return cls(model, target_layer_ids)

    # ------------------------------------------------------------------ vocabulary
    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """p_t's logits at the given positions only (hidden-state communication)."""
        head = self.model.get_output_embeddings()
        return head(final_hidden.to(head.weight.dtype))

    # ------------------------------------------------------------------ features
    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> TargetFeatures:
        """Run the target once. input_ids [S] or [B, S] -> context [.., S, m*H], final [.., S, H]."""
        squeeze = input_ids.dim() == 1
        ids = input_ids[None] if squeeze else input_ids
        captured: dict[int, torch.Tensor] = {}
        wanted = set(self.target_layer_ids)

        def hook(idx: int):
            def fn(_module, _inputs, output):
                # Output of decoder layer idx == input of layer idx + 1 (SGLang's capture).
                captured[idx] = output[0] if isinstance(output, tuple) else output

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(wanted)]
        try:
            out = self.base(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        context = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        if squeeze:
            return TargetFeatures(context[0], final[0])
        return TargetFeatures(context, final)


def pad_right(tensors: Sequence[torch.Tensor], value: float = 0) -> torch.Tensor:
    """[len_i, ...] tensors as one [N, max len, ...] tensor, padded at the end with ``value``."""
    return torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True, padding_value=value)


def padded_batch(input_ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token sequences [S_i] as right-padded ids [N, S] and their attention mask (None when no
    sequence is padded). Right padding changes no real row of a causal model: row t attends
    to rows <= t, all real, at positions 0..t as in a forward of that sequence alone."""
    ids = pad_right(input_ids)
    lens = torch.tensor([t.numel() for t in input_ids], device=ids.device)
    if bool((lens == ids.shape[1]).all()):
        return ids, None
    return ids, (torch.arange(ids.shape[1], device=ids.device) < lens[:, None]).long()


def load_target_config(target_dir: str | Path) -> dict:
    """The target's config.json as a dict (text_config flattened for multimodal configs)."""
    import json

    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise DraftConfigError(
            f"{path} does not exist; pass the target model directory (Hugging Face format)."
        )
    raw = json.loads(path.read_text())
    text = raw.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        raw = {**raw, **text}
    return raw


def make_tiny_target(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 64,
    vocab_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Write a small random Llama / Qwen3 causal LM (HF format) for tests and demos."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 512,
        "tie_word_embeddings": arch == "llama",
    }
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen3":
        config, cls = Qwen3Config(head_dim=hidden_size // num_heads, **common), Qwen3ForCausalLM
    else:
        raise ValueError(f"arch {arch!r} is not llama or qwen3")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out

"""MTP-1 drafter: DeepSeek-V3's NextN (multi-token prediction) module, served by SGLang's
EAGLE3 worker as ``LlamaForCausalLMEagle3`` with ``eagle_config.use_aux_hidden_state: false``.

It is the baseline DSpark is compared against. One decoder layer (SGLang's "input layer",
layer 0) reads, at draft position t, the target's final normed hidden state h_t and the
embedding e_{t+1} = Emb(x_{t+1}) of the next token (the target's frozen embedding):

    r_0  = h_t                                                     (residual)
    u    = [ RMSNorm_in(e_{t+1}) ; RMSNorm_h(h_t) ]                (input_layernorm, hidden_norm; 2H)
    a    = W_o Attn( RoPE_t(u W_q), RoPE_{<=t}(u W_k), u W_v )    (causal over positions 0..t)
    r_1  = a + r_0
    y    = W_down( SiLU(W_gate z) * W_up z ),  z = RMSNorm_post(r_1)
    o_t  = RMSNorm_out(y + r_1)                                    (norm)
    p_d(x_{t+2} | x_{<=t+1}) = softmax( o_t W_lm^T )               (the target's LM head)

RoPE is the target's (theta and rope type), at position t, and the causal attention runs
over the draft's own earlier positions (in serving its KV cache holds them). This is exactly
``srt/models/llama_eagle3.py`` (``LlamaDecoderLayer`` with ``is_input_layer``,
``LlamaModel.forward``; ``fc`` is skipped there because the target hidden width equals H), and
the parameter names are the ones its ``load_weights`` expects (it fuses q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` itself).

Training (``train_mtp.py``): for a sequence x_0..x_{S-1} the layer runs causally over rows
i = 0..n-1 with inputs (h_i, x_{i+1}) at position i, and row i is supervised against
x_{i+2} and the target's p_t(. | x_{<=i+1}) = softmax(h_{i+1} W_lm^T). Several sequences are
packed row-wise; attention never crosses a sequence boundary (``seq_lens``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dspark.drafter.config import DraftConfigError, _as_dict
from sglang_dspark.drafter.model import DSparkMLP, RMSNorm, SharedVocab, apply_rope

# The class SGLang's registry maps this architecture tag to (srt/models/llama_eagle3.py).
SGLANG_MTP_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Static RoPE variants: inv_freq does not depend on the sequence length (SGLang and HF agree).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def is_mtp_config(raw: Mapping[str, Any]) -> bool:
    """True for a config.json (or our draft_config dict) that describes an MTP draft."""
    return SGLANG_MTP_ARCHITECTURE in (raw.get("architectures") or [])


@dataclass
class MtpDraftConfig:
    """An MTP-1 drafter shaped like its target (one Llama layer with a 2H-wide q/k/v input)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    # The target's RoPE keys as its config.json spells them (rope_theta / rope_scaling /
    # rope_parameters), written back verbatim so SGLang builds the target's rotary embedding.
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_theta": 10000.0})
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"

    @classmethod
    def for_target(cls, target_config: Any) -> MtpDraftConfig:
        t = _as_dict(target_config)
        hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(t.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or hidden // heads),
            vocab_size=int(t["vocab_size"]),
            rms_norm_eps=float(t.get("rms_norm_eps") or 1e-6),
            rope={k: t[k] for k in _ROPE_KEYS if t.get(k) is not None} or {"rope_theta": 10000.0},
            max_position_embeddings=int(t.get("max_position_embeddings") or 32768),
            hidden_act=str(t.get("hidden_act") or "silu"),
        )

    # ------------------------------------------------------------------ RoPE
    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The RoPE parameters as transformers (and so SGLang's config) normalise them."""
        from transformers import LlamaConfig

        hf = LlamaConfig(**self.rope, max_position_embeddings=self.max_position_embeddings)
        return dict(hf.rope_parameters)

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """inv_freq [head_dim / 2] and the cos/sin scale of the target's (static) RoPE."""
        p = self.rope_parameters
        kind = p.get("rope_type", "default")
        if kind == "default":
            hd = self.head_dim
            theta = float(p["rope_theta"])
            return 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd), 1.0
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=p,
        )
        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, None)
        return inv_freq.float(), float(scale)

    # ------------------------------------------------------------------ config.json
    def to_sglang_dict(self) -> dict[str, Any]:
        """The config.json SGLang 0.5.23 serves with ``--speculative-algorithm EAGLE3``."""
        return {
            "architectures": [SGLANG_MTP_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            **self.rope,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "mlp_bias": False,
            "num_hidden_layers": 1,
            # false: SGLang then builds its own lm_head and, with draft_vocab_size None,
            # sets load_lm_head_from_target, so the EAGLE3 worker installs the target's
            # embedding AND LM head (set_embed_and_head). With true, lm_head would be the
            # draft's embed_tokens and only the embedding is shared (set_embed).
            "tie_word_embeddings": False,
            # Must be present: LlamaForCausalLMEagle3.__init__ reads config.draft_vocab_size
            # and a LlamaConfig without the key raises AttributeError. None = the full target
            # vocabulary (no d2t / hot-token map).
            "draft_vocab_size": None,
            # Target final hidden state, not aux layers: spec_aux_hidden_state.py reads
            # use_aux_hidden_state, then eagle_aux_hidden_state_layer_ids inside a
            # try/except KeyError, so the ids are not needed.
            "eagle_config": {"use_aux_hidden_state": False},
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MtpDraftConfig:
        """Parse our export's config.json; refuse anything that is not this MTP-1 form."""
        raw = dict(raw)
        if not is_mtp_config(raw):
            raise DraftConfigError(
                f"architectures is {raw.get('architectures')}, not [{SGLANG_MTP_ARCHITECTURE!r}]"
                "; this is not an MTP draft (DSpark drafts load with load_draft)."
            )
        missing = [
            k
            for k in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
            if raw.get(k) is None
        ]
        if missing:
            raise DraftConfigError(
                f"MTP draft config.json lacks {missing}; re-export it with `sglang-dspark export`."
            )
        problems = []
        if int(raw.get("num_hidden_layers", 1)) != 1:
            problems.append(
                f"num_hidden_layers is {raw['num_hidden_layers']}; an MTP-1 draft has exactly 1."
            )
        if (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True):
            problems.append(
                "eagle_config.use_aux_hidden_state is not false: SGLang would feed the draft "
                "aux target layers through fc instead of the final hidden state it was trained "
                'on. Set "eagle_config": {"use_aux_hidden_state": false}.'
            )
        dvs = raw.get("draft_vocab_size")
        if dvs is not None and int(dvs) != int(raw["vocab_size"]):
            problems.append(
                f"draft_vocab_size {dvs} != vocab_size {raw['vocab_size']}: a reduced draft "
                "vocabulary (d2t map) is not what this drafter trains; set it to null."
            )
        if problems:
            raise DraftConfigError("invalid MTP draft config:\n  - " + "\n  - ".join(problems))
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope={k: raw[k] for k in _ROPE_KEYS if raw.get(k) is not None}
            or {"rope_theta": 10000.0},
            max_position_embeddings=int(raw.get("max_position_embeddings") or 32768),
            hidden_act=str(raw.get("hidden_act") or "silu"),
        )

    @classmethod
    def load(cls, draft_dir: str | Path) -> MtpDraftConfig:
        path = Path(draft_dir) / "config.json"
        if not path.is_file():
            raise DraftConfigError(
                f"{path} does not exist; an MTP draft directory holds config.json and "
                "model.safetensors (write one with `sglang-dspark export` or "
                "`sglang-dspark make-draft --kind mtp`)."
            )
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise DraftConfigError(f"{path} is not valid JSON ({e}); re-export the draft.") from e

    # ------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        out = []
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            out.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}."
            )
        if self.hidden_act != "silu":
            out.append(f"hidden_act {self.hidden_act!r}: the MTP layer's MLP is Llama's SiLU.")
        kind = self.rope_parameters.get("rope_type", "default")
        if kind not in SUPPORTED_ROPE_TYPES:
            out.append(
                f"rope_type {kind!r} is not implemented by MtpDrafter (only the static "
                f"{SUPPORTED_ROPE_TYPES}); its positions would not match SGLang's."
            )
        return out

    def problems_for_target(self, target_config: Any) -> list[str]:
        """Why this draft would not serve correctly with this target (empty when it fits)."""
        t = _as_dict(target_config)
        out = self.problems()
        t_hidden, t_vocab = int(t.get("hidden_size") or 0), int(t.get("vocab_size") or 0)
        if self.hidden_size != t_hidden:
            out.append(
                f"draft hidden_size {self.hidden_size} differs from the target's {t_hidden}: the "
                "MTP layer reads the target's final hidden state and shares its embedding and "
                "LM head. Use a draft exported for this target."
            )
        if self.vocab_size != t_vocab:
            out.append(
                f"draft vocab_size {self.vocab_size} differs from the target vocabulary "
                f"({t_vocab}); SGLang installs the target's LM head, so they must be equal. Use "
                "a draft exported for this target."
            )
        t_max = t.get("max_position_embeddings")
        if t_max and self.max_position_embeddings < int(t_max):
            out.append(
                f"draft max_position_embeddings {self.max_position_embeddings} is below the "
                f"target's {t_max}; SGLang's RoPE cache would be too short for long contexts."
            )
        return out

    def check(self) -> None:
        found = self.problems()
        if found:
            raise DraftConfigError("invalid MTP draft config:\n  - " + "\n  - ".join(found))


# ---------------------------------------------------------------------------- model
class MtpAttention(nn.Module):
    """Llama GQA attention whose q/k/v read the 2H-wide [e; h] input; causal, RoPE at t."""

    def __init__(self, cfg: MtpDraftConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(2 * H, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)
        inv_freq, self.rope_scale = cfg.rope_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, u: torch.Tensor, positions: torch.Tensor, seq_lens: Sequence[int]
    ) -> torch.Tensor:
        """u [N, 2H] (packed rows of len(seq_lens) sequences), positions [N] -> [N, H]; or
        batched, u [N, T, 2H] (right-padded sequences), positions [N, T] -> [N, T, H]."""
        freqs = positions.float()[..., None] * self.inv_freq.to(u.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        q = apply_rope(self.q_proj(u).unflatten(-1, (self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_proj(u).unflatten(-1, (self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(u).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if u.dim() == 3:  # causal: a real row never reads the padding after it
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, enable_gqa=True,
            )  # fmt: skip
            return self.o_proj(o.transpose(1, 2).flatten(2))
        outs = []
        for qs, ks, vs in zip(*(t.split(list(seq_lens)) for t in (q, k, v))):  # per sequence
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                is_causal=True, enable_gqa=True,
            )  # fmt: skip
            outs.append(o.transpose(0, 1).flatten(1))
        return self.o_proj(torch.cat(outs))


class MtpDecoderLayer(nn.Module):
    def __init__(self, cfg: MtpDraftConfig) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)  # on the token embedding e_{t+1}
        self.hidden_norm = RMSNorm(H, eps)  # on the target hidden state h_t
        self.self_attn = MtpAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = DSparkMLP(cfg)  # Llama SiLU MLP (reads hidden/intermediate size only)

    def forward(self, e, h, positions, seq_lens) -> torch.Tensor:
        u = torch.cat([self.input_layernorm(e), self.hidden_norm(h)], dim=-1)
        r = h + self.self_attn(u, positions, seq_lens)
        return r + self.mlp(self.post_attention_layernorm(r))  # y + r_1 (before the norm)


class MtpDrafter(nn.Module):
    """The NextN layer + final norm; embedding and LM head are the target's (not params)."""

    def __init__(self, config: MtpDraftConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        self.layers = nn.ModuleList([MtpDecoderLayer(config)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.shared: SharedVocab | None = None  # plain attribute: never in state_dict

    def attach_shared(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self.shared = SharedVocab.checked(
            embed_weight, lm_head_weight, vocab_size=self.config.vocab_size,
            hidden_size=self.config.hidden_size, drafter="MTP drafter",
        )  # fmt: skip

    def _require_shared(self) -> SharedVocab:
        if self.shared is None:
            raise RuntimeError("the drafter has no target embedding / LM head; attach_shared()")
        return self.shared

    def forward(
        self,
        target_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """o_t [N, H] for rows (h_t, x_{t+1}) at position t; rows are packed sequences of
        ``seq_lens`` (default: one sequence), each attended causally within itself. Batched:
        target_hidden [N, T, H], next_tokens / positions [N, T] -> [N, T, H]."""
        if target_hidden.dim() == 3:
            seq_lens = None
        else:
            seq_lens = [target_hidden.shape[0]] if seq_lens is None else list(seq_lens)
        dtype = self.norm.weight.dtype
        e = F.embedding(next_tokens, self._require_shared().embed_weight).to(dtype)
        x = target_hidden.to(dtype)
        for layer in self.layers:
            x = layer(e, x, positions, seq_lens)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """o_t W_lm^T through the target's frozen LM head."""
        w = self._require_shared().lm_head_weight
        return F.linear(hidden.to(w.dtype), w)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.state_dict().items()}

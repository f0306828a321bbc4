"""The DeepSeek-V4 DSpark draft: SGLang 0.5.23's ``DeepseekV4ForCausalLMDSpark`` in PyTorch.

What SGLang runs at serving (``srt/models/deepseek_v4_dspark.py``, the block metadata in
``kernels/ops/speculative/dspark/dspark_attn_metadata.py``), and what :class:`DSparkV4Drafter`
computes for training:

    main_x   = main_norm( main_proj [H(l_1); ...; H(l_m)] )        stage 0's W_c, [S, H]
    ctx_kv_s = rope( kv_norm_s( wkv_s main_x ), position )           every stage s, [S, 512]

``H(l)`` is the mean over the mHC streams of target layer l's output (``target_v4.py``).
The context rows' KV is written straight from ``main_x`` (``CommitKvProj``: no mHC, no
input norm), one per stage. A block is ``[anchor, mask x (gamma-1)]`` at positions
a..a+gamma-1; its embedding (the target's) is repeated over the ``hc_mult`` streams and runs
through the m stages, each a sliding-window DeepSeek-V4 decoder layer:

    attention: (post, comb, x) = mHC_attn(streams); x = attn_norm(x)
        q = rope( headnorm( wq_b q_norm( wq_a x ) ) ),  k = v = rope( kv_norm( wkv x ) )
        every block row attends to the last min(a, 128) context rows (positions < a; the
        window SGLang's ``compute_dspark_window_gather`` builds, ``SWA_WINDOW`` = 128) and to
        all gamma block rows (bidirectional), one KV head, a per-head attention sink;
        out = wo_b( wo_a_grouped( rope^-1(o) ) );  streams = post * out + comb^T streams
    MoE:       (post, comb, x) = mHC_ffn(streams); x = ffn_norm(x)
        sqrtsoftplus top-k routing (noaux_tc bias, no hash layers in a draft), renormalised
        weights x routed_scaling_factor, clamped SwiGLU experts + one shared expert
    head:      x_post_hc = hc_head(streams)   (last stage's hc_head_*; the confidence input)
               U_k = lm_head( norm(x_post_hc) )  (last stage's norm, target's LM head)

Sequential stage and confidence head as on every DSpark draft: B_k = W2 W1[x_{k-1}]
(``markov_head.embed`` / ``.head``, vanilla only), c_k = sigmoid(w^T [x_post_hc_k;
W1[x_{k-1}]]) with no bias (``DSparkConfidenceHead(bias=False)``).

Reused from transformers 5.19 (``models/deepseek_v4``), each checked against SGLang's maths:
``DeepseekV4DecoderLayer`` as the container of a stage's modules and its names (their
``DeepseekV4HyperConnection`` = SGLang's ``hc_pre`` + ``hc_split_sinkhorn``: sigmoid + eps
pre, 2 sigmoid post, softmax + eps then Sinkhorn starting with a column pass;
``DeepseekV4SparseMoeBlock`` / ``DeepseekV4TopKRouter`` / ``DeepseekV4Experts`` /
``DeepseekV4MLP`` = SGLang's ``DeepseekV2MoE`` with ``biased_topk_impl`` and
``silu_and_mul_clamp``; ``q_a_proj``/``q_a_norm``/``q_b_proj``/``q_b_norm``/``kv_proj``/
``kv_norm``/``o_a_proj`` (``DeepseekV4GroupedLinear``)/``o_b_proj``/``sinks``),
``DeepseekV4HyperHead`` (= ``hc_head_torch``), ``DeepseekV4RMSNorm`` and
``apply_rotary_pos_emb`` (interleaved pairs, = SGLang's complex ``apply_rotary_emb``).
The attention itself is written here, because transformers' ``DeepseekV4Attention.forward``
is causal self-attention over one sequence, not a block over injected context. RoPE on the
draft is SGLang's ``precompute_freqs_cis`` with ``original_seq_len = 0``: plain RoPE at
``rope_theta`` over the last ``qk_rope_head_dim`` channels.

Not modelled: SGLang stores the KV rows in fp8 (448 nope channels, UE8M0 block scales) with
bf16 rope channels; training keeps them in the compute dtype.

Training packs many blocks into one call with the dense trainer's :class:`BlockLayout`
(``ctx_lo`` / ``ctx_hi`` index vectors): block b sees context rows
``max(ctx_lo[b], ctx_hi[b] - 128) <= j < ctx_hi[b]``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dspark.drafter.confidence import ConfidenceHead
from sglang_dspark.drafter.config import DraftConfigError, _as_dict, default_mask_token_id
from sglang_dspark.drafter.markov_head import VanillaMarkov
from sglang_dspark.drafter.model import BlockLayout, DrafterHeads, SharedVocab

logger = logging.getLogger(__name__)

SWA_WINDOW = 128  # SGLang's fixed DSpark draft context window (deepseek_v4_backend.SWA_WINDOW)
V4_MODEL_TYPES = ("deepseek_v4",)
# config.json fields the draft's stages (and SGLang's DeepseekV4ForCausalLMDSpark) read.
REQUIRED_TARGET_FIELDS = (
    "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "swiglu_limit", "scoring_func", "rope_theta", "rms_norm_eps",
)  # fmt: skip
# The dspark_* keys a V4 config.json carries for a bundled draft (SGLang's
# checkpoint_bundles_dspark_draft / parse_dspark_draft_config).
DSPARK_KEYS = (
    "dspark_block_size", "dspark_markov_rank", "dspark_markov_head_type",
    "dspark_target_layer_ids", "dspark_noise_token_id", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok", "enable_confidence_head", "confidence_head_with_markov",
)  # fmt: skip


def is_v4_config(target_config: Any) -> bool:
    t = _as_dict(target_config)
    archs = t.get("architectures") or []
    return t.get("model_type") in V4_MODEL_TYPES or "DeepseekV4ForCausalLM" in archs


def v4_target_problems(target_config: Any) -> list[str]:
    """Why this target cannot get a V4 DSpark draft (empty when it can)."""
    t = _as_dict(target_config)
    if not is_v4_config(t):
        arch = (t.get("architectures") or ["?"])[0]
        return [
            (
                f"the target is {arch} (model_type {t.get('model_type')!r}), not DeepSeek-V4; "
                "--drafter dspark-v4 trains DeepSeek-V4 drafts (DeepseekV4ForCausalLMDSpark) "
                "only. Use --drafter dspark for Llama / Qwen-style targets."
            )
        ]
    out = []
    missing = [k for k in REQUIRED_TARGET_FIELDS if t.get(k) is None]
    if t.get("window_size") is None and t.get("sliding_window") is None:
        missing.append("window_size")
    if missing:
        out.append(
            f"the target's config.json lacks {missing}, which the V4 DSpark draft's stages "
            "need (SGLang's DeepseekV4ForCausalLMDSpark reads them too); give the full "
            "DeepSeek-V4 config.json of the checkpoint."
        )
        return out
    if t.get("hc_pre_from_prev_sublayer"):
        out.append(
            "hc_pre_from_prev_sublayer is set (the V4.1 mHC scheme): SGLang then captures the "
            "draft's features at another point and collapses the draft differently; only the "
            "V4 scheme is implemented here."
        )
    if t.get("scoring_func") != "sqrtsoftplus":
        out.append(f"scoring_func {t.get('scoring_func')!r}: only V4's sqrtsoftplus is modelled.")
    if int(t.get("n_shared_experts") or 1) != 1:
        out.append(
            f"n_shared_experts {t.get('n_shared_experts')}: the draft's shared expert is "
            "modelled with width moe_intermediate_size (n_shared_experts = 1)."
        )
    if t.get("norm_topk_prob") is False:
        out.append("norm_topk_prob is false: the draft's router always renormalises.")
    if int(t["head_dim"]) <= int(t["qk_rope_head_dim"]):
        out.append(
            f"head_dim {t['head_dim']} must exceed qk_rope_head_dim {t['qk_rope_head_dim']}."
        )
    return out


def default_v4_layer_ids(num_target_layers: int, num_features: int = 3) -> list[int]:
    """m target layers spread over the stack, the last one included (SGLang captures a V4
    layer's own output, so the last layer is a valid capture point)."""
    L, m = int(num_target_layers), max(1, min(int(num_features), int(num_target_layers)))
    return sorted({round(L - 1 - i * (L - 1) / m) for i in range(m)})


@dataclass
class V4DraftConfig:
    """A V4 DSpark draft: the target's config plus the ``dspark_*`` fields."""

    target: dict[str, Any]  # the target's config.json (everything the stages read)
    target_layer_ids: list[int]  # one stage per id (SGLang: num_stages = len(ids))
    block_size: int = 5  # gamma
    markov_rank: int = 256
    mask_token_id: int = 0
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    markov_head_type: str = "vanilla"

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(
        cls, target_config: Any, *, target_layer_ids: Sequence[int] | None = None,
        block_size: int | None = None, markov_rank: int | None = None,
        mask_token_id: int | None = None, num_context_features: int | None = None,
    ) -> V4DraftConfig:  # fmt: skip
        """A draft shaped for ``target_config``. Unset fields come from the target's bundled
        ``dspark_*`` keys when it has them, else from its own shapes (the MoE of the target,
        :func:`default_v4_layer_ids`, :func:`default_mask_token_id`)."""
        t = _as_dict(target_config)
        problems = v4_target_problems(t)
        if problems:
            raise DraftConfigError(
                "cannot train a V4 DSpark draft:\n  - " + "\n  - ".join(problems)
            )
        ids = target_layer_ids or t.get("dspark_target_layer_ids")
        if ids is None:
            ids = default_v4_layer_ids(t["num_hidden_layers"], num_context_features or 3)
        if mask_token_id is None:
            mask_token_id = t.get("dspark_noise_token_id")
        return cls(
            target={k: v for k, v in t.items() if k not in DSPARK_KEYS},
            target_layer_ids=[int(x) for x in ids],
            block_size=int(block_size or t.get("dspark_block_size") or 5),
            markov_rank=int(markov_rank or t.get("dspark_markov_rank") or 256),
            mask_token_id=int(default_mask_token_id(t) if mask_token_id is None else mask_token_id),
            n_routed_experts=int(t.get("dspark_n_routed_experts") or t["n_routed_experts"]),
            num_experts_per_tok=int(
                t.get("dspark_num_experts_per_tok") or t["num_experts_per_tok"]
            ),
        )

    @classmethod
    def from_config_json(cls, raw: Mapping[str, Any]) -> V4DraftConfig:
        """The draft a V4 config.json with ``dspark_*`` keys describes (a bundled draft, or
        our export)."""
        t = dict(raw)
        if t.get("dspark_target_layer_ids") is None:
            raise DraftConfigError(
                "this V4 config.json has no dspark_target_layer_ids: it carries no DSpark draft."
            )
        cfg = cls.for_target(t)
        head = str(t.get("dspark_markov_head_type") or "vanilla").lower()
        return dataclasses.replace(
            cfg,
            markov_head_type=head,
            enable_confidence_head=bool(t.get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(t.get("confidence_head_with_markov", True)),
        )

    # ------------------------------------------------------------------ shapes
    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.target["vocab_size"])

    @property
    def num_stages(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_target_layers(self) -> int:
        return int(self.target["num_hidden_layers"])

    @property
    def hc_mult(self) -> int:
        return int(self.target["hc_mult"])

    @property
    def rope_head_dim(self) -> int:
        return int(self.target["qk_rope_head_dim"])

    @property
    def rope_theta(self) -> float:
        return float(self.target["rope_theta"])

    # ------------------------------------------------------------------ config.json
    def to_sglang_dict(self) -> dict[str, Any]:
        """The ``dspark_*`` keys SGLang reads from a V4 config.json for the draft."""
        return {
            "dspark_block_size": self.block_size,
            "dspark_markov_rank": self.markov_rank,
            "dspark_markov_head_type": self.markov_head_type,
            "dspark_target_layer_ids": list(self.target_layer_ids),
            "dspark_noise_token_id": self.mask_token_id,
            "dspark_n_routed_experts": self.n_routed_experts,
            "dspark_num_experts_per_tok": self.num_experts_per_tok,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
        }

    def config_json(self) -> dict[str, Any]:
        """The target's config.json with this draft's ``dspark_*`` keys: what an exported
        draft directory (or a bundled target copy) carries."""
        return {**self.target, **self.to_sglang_dict()}

    def problems(self) -> list[str]:
        out = v4_target_problems(self.target)
        L = self.num_target_layers
        ids = self.target_layer_ids
        if not ids:
            out.append("target_layer_ids is empty; list at least one target layer.")
        bad = [i for i in ids if not 0 <= i < L]
        if bad:
            out.append(
                f"target_layer_ids {bad} are outside 0..{L - 1} for this {L}-layer target "
                "(a V4 id names the layer whose output SGLang captures; the last one is valid)."
            )
        if any(b <= a for a, b in itertools.pairwise(ids)):
            out.append(f"target_layer_ids {ids} must be strictly increasing (SGLang captures "
                       "in layer order, once per layer).")  # fmt: skip
        if self.markov_rank <= 0:
            out.append(f"markov_rank is {self.markov_rank}; the V4 DSpark draft requires > 0.")
        if self.markov_head_type != "vanilla":
            out.append(
                f"markov_head_type {self.markov_head_type!r}: SGLang's V4 draft has the "
                "vanilla Markov head only (DSparkV4MarkovHead)."
            )
        if self.block_size < 1:
            out.append(f"block_size (gamma) is {self.block_size}; it must be >= 1.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            out.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                       f"({self.vocab_size}); set it below {self.vocab_size}.")  # fmt: skip
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            out.append(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                       f"1..n_routed_experts ({self.n_routed_experts}).")  # fmt: skip
        return out

    def check(self) -> None:
        found = self.problems()
        if found:
            raise DraftConfigError("invalid V4 DSpark draft config:\n  - " + "\n  - ".join(found))

    def hf_stage_config(self, *, vocab_size: int | None = None):
        """transformers' ``DeepseekV4Config`` for the m stages: sliding-window layers with the
        draft's MoE, no hash routing (SGLang's ``_dspark_stage_config`` and
        ``DeepseekV2MoE(is_nextn=True)``)."""
        from transformers import DeepseekV4Config

        t, n = self.target, self.num_stages
        hf = DeepseekV4Config(
            vocab_size=int(vocab_size or self.vocab_size),
            hidden_size=self.hidden_size,
            moe_intermediate_size=int(t["moe_intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(t["num_attention_heads"]),
            head_dim=int(t["head_dim"]),
            partial_rotary_factor=self.rope_head_dim / int(t["head_dim"]),
            q_lora_rank=int(t["q_lora_rank"]),
            o_groups=int(t["o_groups"]),
            o_lora_rank=int(t["o_lora_rank"]),
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            n_shared_experts=1,
            layer_types=["sliding_attention"] * n,
            mlp_layer_types=["moe"] * n,
            sliding_window=int(t.get("sliding_window") or t["window_size"]),
            hc_mult=self.hc_mult,
            hc_sinkhorn_iters=int(t["hc_sinkhorn_iters"]),
            hc_eps=float(t["hc_eps"]),
            rms_norm_eps=float(t["rms_norm_eps"]),
            scoring_func=str(t["scoring_func"]),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(t["swiglu_limit"]),
            rope_theta=self.rope_theta,
            max_position_embeddings=int(t.get("max_position_embeddings") or 65536),
            initializer_range=float(t.get("initializer_range") or 0.02),
        )
        hf._experts_implementation = "eager"  # the reference loop (differentiable, any shape)
        return hf


# ----------------------------------------------------------------------------- model
def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float):
    """Half-size cos / sin [..., rope_dim / 2] for ``apply_rotary_pos_emb`` (interleaved
    pairs): SGLang's ``precompute_freqs_cis(original_seq_len=0)``, plain RoPE."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device)
                  / rope_dim)
    )  # fmt: skip
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's interleaved RoPE on the trailing rope channels of x [..., D] (one row per
    position) or x [..., heads, D] when cos / sin [...] have one dim less than x."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    if x.dim() == cos.dim():
        return apply_rotary_pos_emb(x.unsqueeze(-2), cos, sin, unsqueeze_dim=-2).squeeze(-2)
    return apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=-2)


class V4ConfidenceHead(ConfidenceHead):
    """c_k = sigmoid(w^T [x_post_hc_k; W1[x_{k-1}]]), no bias (SGLang's V4 head)."""

    def __init__(self, *, hidden_size: int, markov_rank: int, with_markov: bool = True) -> None:
        super().__init__(hidden_size=hidden_size, markov_rank=markov_rank, with_markov=with_markov)
        self.proj = nn.Linear(self.proj.in_features, 1, bias=False)


class DSparkV4Drafter(DrafterHeads, nn.Module):
    """m V4 stages + hc head + final norm, ``main_proj`` / ``main_norm``, Markov and
    confidence heads. Parameter names are transformers' (``layers.{s}.self_attn.kv_proj``,
    ...); ``train_v4.draft_tensors`` renames them to SGLang's ``mtp.{s}.…``."""

    drafter_name = "V4 drafter"

    def __init__(self, config: V4DraftConfig) -> None:
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        config.check()
        self.config = config
        hf = config.hf_stage_config(vocab_size=16)
        self.hf_config = hf
        H, m = config.hidden_size, config.num_context_features
        self.layers = nn.ModuleList(
            [DeepseekV4DecoderLayer(hf, i) for i in range(hf.num_hidden_layers)]
        )
        self.hc_head = DeepseekV4HyperHead(hf)
        self.norm = DeepseekV4RMSNorm(H, eps=hf.rms_norm_eps)
        self.main_proj = nn.Linear(m * H, H, bias=False)  # W_c
        self.main_norm = DeepseekV4RMSNorm(H, eps=hf.rms_norm_eps)
        self.markov_head = VanillaMarkov(
            vocab_size=config.vocab_size, markov_rank=config.markov_rank
        )
        self.confidence_head: V4ConfidenceHead | None = (
            V4ConfidenceHead(
                hidden_size=H,
                markov_rank=config.markov_rank,
                with_markov=config.confidence_head_with_markov,
            )
            if config.enable_confidence_head
            else None
        )
        self.shared: SharedVocab | None = None  # plain attribute: never in state_dict

    # ------------------------------------------------------------------ parallel stage
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """main_x = main_norm(main_proj [H(l_1); ...; H(l_m)]): SGLang's
        ``project_target_hidden``; target_features [S, m*H]."""
        expected = self.main_proj.in_features
        if target_features.shape[-1] != expected:
            raise ValueError(
                f"target features have width {target_features.shape[-1]}, expected {expected} "
                f"({self.config.num_context_features} layers x {self.config.hidden_size})"
            )
        return self.main_norm(self.main_proj(target_features.to(self.main_proj.weight.dtype)))

    def _attention(self, attn, x, cos_q, sin_q, ctx_kv, ctx_visible) -> torch.Tensor:
        """One stage's block attention. x [B, g, H] (normed); ctx_kv [B, W, D] (window rows,
        roped at their positions); ctx_visible [B, W]."""
        B, g, _ = x.shape
        D = attn.head_dim
        q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(B, g, -1, D)
        q = _rope(attn.q_b_norm(q), cos_q, sin_q)
        kv = _rope(attn.kv_norm(attn.kv_proj(x)), cos_q, sin_q)
        s_ctx = torch.einsum("bqhd,bwd->bhqw", q, ctx_kv.to(q.dtype)).float() * attn.scaling
        s_ctx = s_ctx.masked_fill(~ctx_visible[:, None, None, :], float("-inf"))
        s_blk = torch.einsum("bqhd,bpd->bhqp", q, kv).float() * attn.scaling  # bidirectional
        sink = attn.sinks.float().view(1, -1, 1, 1).expand(B, -1, g, 1)
        logits = torch.cat([s_ctx, s_blk, sink], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)
        W = ctx_kv.shape[1]
        p_ctx, p_blk = probs[..., :W].to(kv.dtype), probs[..., W : W + g].to(kv.dtype)
        o = torch.einsum("bhqw,bwd->bqhd", p_ctx, ctx_kv.to(kv.dtype))
        o = o + torch.einsum("bhqp,bpd->bqhd", p_blk, kv)
        o = _rope(o, cos_q, -sin_q)  # undo the rope V's rope slice carries
        grouped = attn.o_a_proj(o.reshape(B, g, self.hf_config.o_groups, -1)).flatten(2)
        return attn.o_b_proj(grouped)

    def forward(self, target_features: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """x_post_hc [B, gamma, H] of every block in ``layout``: the collapsed streams before
        the final norm (SGLang's ``confidence_features``; :meth:`base_logits` applies the
        norm). A batched layout (context [N, S, m*H]) runs packed and comes back as
        [N, A, gamma, H]: each block reads a fixed window, so packing costs nothing extra."""
        if target_features.dim() == 3:
            N, A = layout.block_ids.shape[:2]
            out = self.forward(target_features.flatten(0, 1), layout.packed())
            return out.unflatten(0, (N, A))
        cfg = self.config
        main_x = self.project_context(target_features)
        # Window: the last SWA_WINDOW context rows before the anchor, within the sequence.
        idx = layout.ctx_hi[:, None] - SWA_WINDOW + torch.arange(SWA_WINDOW, device=main_x.device)
        ctx_visible = idx >= layout.ctx_lo[:, None]
        idx = idx.clamp(min=0)
        cos_c, sin_c = rope_cos_sin(layout.ctx_positions, cfg.rope_head_dim, cfg.rope_theta)
        cos_q, sin_q = rope_cos_sin(layout.positions, cfg.rope_head_dim, cfg.rope_theta)
        embed = F.embedding(layout.block_ids, self._require_shared().embed_weight)
        x = embed.to(main_x.dtype).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        dtype = x.dtype
        for layer in self.layers:
            attn = layer.self_attn
            # CommitKvProj (wkv of main_x), then the KV store's norm and rope; window rows.
            ctx_kv = _rope(attn.kv_norm(attn.kv_proj(main_x)), cos_c, sin_c)[idx]  # [B, W, D]
            post, comb, collapsed = layer.attn_hc(x)
            y = self._attention(attn, layer.input_layernorm(collapsed), cos_q, sin_q, ctx_kv,
                                ctx_visible)  # fmt: skip
            x = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), x
            )
            post, comb, collapsed = layer.ffn_hc(x)
            y = layer.mlp(layer.post_attention_layernorm(collapsed))
            x = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), x
            )
        return self.hc_head(x)

    def lm_head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """U_k = lm_head(norm(x_post_hc_k)): the LM head reads the normed state."""
        return self.norm(hidden)


@torch.no_grad()
def init_v4_weights(drafter: DSparkV4Drafter, *, seed: int = 0) -> None:
    """transformers' DeepseekV4 initialisation for the stages, hc head and norms (mHC fn
    normal, base 0, scale 1; sinks 0; router and experts normal), seeded; N(0, 0.02) for
    main_proj and the Markov tables, zeros for the confidence head. The global RNG is left
    alone."""
    from transformers import DeepseekV4Model

    std = float(drafter.hf_config.initializer_range)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        ref = DeepseekV4Model(copy.deepcopy(drafter.hf_config))
        gen = torch.Generator().manual_seed(int(seed) + 1)
    drafter.layers.load_state_dict(ref.layers.state_dict())
    drafter.hc_head.load_state_dict(ref.hc_head.state_dict())
    drafter.norm.weight.fill_(1.0)
    drafter.main_norm.weight.fill_(1.0)
    for p in (drafter.main_proj.weight, drafter.markov_head.markov_w1.weight,
              drafter.markov_head.markov_w2.weight):  # fmt: skip
        p.copy_(torch.randn(p.shape, generator=gen) * std)
    if drafter.confidence_head is not None:
        drafter.confidence_head.proj.weight.zero_()

"""DSpark's parallel stage: a DFlash-style backbone with KV injection of target hidden states.

    H_ctx = RMSNorm( W_c [H(l_1); ...; H(l_m)] )            (``fc``, ``hidden_norm``)

H_ctx is injected into EVERY draft layer: each layer projects it with its own k/v
projections (k_norm and RoPE at the context token's position on K; no input_layernorm) and
puts those keys/values in front of the block's own. A block is [anchor, mask x (gamma-1)] at
positions a..a+gamma-1; it attends bidirectionally to itself and to the context strictly
before its anchor (positions < a), never to other blocks. Its gamma rows give
h_1..h_gamma (after the final ``norm``) and U_k = h_k W_lm^T through the target's frozen
LM head; the target's frozen embedding embeds the block.

This is exactly what SGLang 0.5.23 computes in ``srt/models/dflash.py`` /
``srt/models/dspark.py`` (``write_target_hidden_kv`` for the context, a TARGET_VERIFY
forward with ENCODER_ONLY attention for the block, ``compute_base_logits``), with the same
parameter names, so a state_dict of :class:`DSparkDrafter` is an SGLang checkpoint.

Training runs many blocks of many sequences in one call, in one of two layouts
(:class:`BlockLayout`). Packed: every sequence's context rows in one [S, m*H] tensor and two
index vectors, ``ctx_lo[b] <= j < ctx_hi[b]``, say which rows block b sees. Batched: context
[N, S, m*H] (sequences padded to one length) and blocks [N, A, gamma] (A per sequence), so
each block's scores cover its own sequence's rows only: the cost grows with N, not N^2 as
packing many sequences does. The only mask ever built is [blocks, context], never [seq, seq].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dspark.drafter.confidence import ConfidenceHead
from sglang_dspark.drafter.config import DSparkDraftConfig
from sglang_dspark.drafter.markov_head import VanillaMarkov, build_markov_head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE tables for ``positions`` [...]: cos, sin [..., head_dim] in fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos/sin [..., head_dim] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass
class BlockLayout:
    """Where each block sits: the index vectors that replace a dense attention mask.

    Packed (context [S, m*H]): block_ids [B, gamma]: [anchor, mask, ..., mask]; positions
    [B, gamma]: a..a+gamma-1; ctx_positions [S]: RoPE position of each packed context row;
    ctx_lo / ctx_hi [B]: block b sees context rows ctx_lo[b] <= j < ctx_hi[b] (its
    sequence's rows before its anchor).

    Batched (context [N, S, m*H], one padded sequence per row): the same fields with a leading
    sequence dim, block_ids / positions [N, A, gamma], ctx_positions [N, S], ctx_lo / ctx_hi
    [N, A] (rows of that sequence). A padding block sees no context (ctx_hi = ctx_lo).
    """

    block_ids: torch.Tensor
    positions: torch.Tensor
    ctx_positions: torch.Tensor
    ctx_lo: torch.Tensor
    ctx_hi: torch.Tensor

    @property
    def anchors(self) -> torch.Tensor:
        return self.block_ids[..., 0]

    @property
    def batched(self) -> bool:
        return self.block_ids.dim() == 3

    def unsqueezed(self) -> BlockLayout:
        """A packed layout as a batch of one."""
        return BlockLayout(*(getattr(self, f)[None] for f in _LAYOUT_FIELDS))

    def packed(self) -> BlockLayout:
        """A batched layout as a packed one over its N*S context rows (context.flatten(0, 1)):
        blocks [N*A, gamma], sequence n's rows at n*S .. n*S + S - 1."""
        N, S = self.ctx_positions.shape
        base = (torch.arange(N, device=self.ctx_lo.device) * S)[:, None]
        return BlockLayout(
            block_ids=self.block_ids.flatten(0, 1),
            positions=self.positions.flatten(0, 1),
            ctx_positions=self.ctx_positions.flatten(),
            ctx_lo=(self.ctx_lo + base).flatten(),
            ctx_hi=(self.ctx_hi + base).flatten(),
        )


_LAYOUT_FIELDS = ("block_ids", "positions", "ctx_positions", "ctx_lo", "ctx_hi")


def single_sequence_layout(
    input_ids: torch.Tensor, anchors: torch.Tensor, *, block_size: int, mask_token_id: int
) -> BlockLayout:
    """Blocks at ``anchors`` [B] of one sequence ``input_ids`` [S], context = that sequence."""
    anchors = anchors.long()
    offsets = torch.arange(block_size, device=anchors.device)
    block_ids = torch.full(
        (anchors.numel(), block_size), int(mask_token_id), dtype=torch.long, device=anchors.device
    )
    block_ids[:, 0] = input_ids[anchors]
    return BlockLayout(
        block_ids=block_ids,
        positions=anchors[:, None] + offsets,
        ctx_positions=torch.arange(input_ids.numel(), device=anchors.device),
        ctx_lo=torch.zeros_like(anchors),
        ctx_hi=anchors.clone(),
    )


class DSparkAttention(nn.Module):
    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scaling = self.head_dim**-0.5
        H, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def context_kv(
        self, ctx: torch.Tensor, ctx_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV injection: K = RoPE(k_norm(H_ctx W_k)), V = H_ctx W_v, each [S, kv_heads, hd]."""
        k = self.k_norm(self.k_proj(ctx).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(ctx).unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = rope_cos_sin(ctx_positions, self.head_dim, self.rope_theta)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_visible: torch.Tensor,
    ) -> torch.Tensor:
        """x [N, B, g, H] (normed block rows of N sequences); ctx_k/ctx_v [N, S, kvh, hd];
        ctx_visible [N, B, S]."""
        N, B, g, _ = x.shape
        kvh, hd = self.num_kv_heads, self.head_dim
        rep = self.num_heads // kvh
        cos, sin = rope_cos_sin(positions, hd, self.rope_theta)
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, hd))), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).unflatten(-1, (kvh, hd))), cos, sin)
        v = self.v_proj(x).unflatten(-1, (kvh, hd))
        # GQA: query head h reads kv head h // rep.  q: [N, B, g, kvh, rep, hd]
        q = q.unflatten(3, (kvh, rep)) * self.scaling
        s_ctx = torch.einsum("nbqkrd,nskd->nbkrqs", q, ctx_k.to(q.dtype))  # [N,B,kvh,rep,g,S]
        s_blk = torch.einsum("nbqkrd,nbpkd->nbkrqp", q, k)  # [N,B,kvh,rep,g,g]: bidirectional
        s_ctx = s_ctx.float().masked_fill(~ctx_visible[:, :, None, None, None, :], float("-inf"))
        probs = torch.softmax(torch.cat([s_ctx, s_blk.float()], dim=-1), dim=-1)
        p_ctx, p_blk = probs.to(v.dtype).split([s_ctx.shape[-1], g], dim=-1)
        out = torch.einsum("nbkrqs,nskd->nbqkrd", p_ctx, ctx_v.to(v.dtype))
        out = out + torch.einsum("nbkrqp,nbpkd->nbqkrd", p_blk, v)
        return self.o_proj(out.reshape(N, B, g, self.num_heads * hd))


class DSparkMLP(nn.Module):
    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DSparkMLP(cfg)

    def forward(self, x, positions, ctx, ctx_positions, ctx_visible) -> torch.Tensor:
        ctx_k, ctx_v = self.self_attn.context_kv(ctx, ctx_positions)
        h = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, ctx_visible)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class SharedVocab:
    """The target's frozen token embedding [V, H] and LM head [V, H] (not drafter params)."""

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor

    @classmethod
    def checked(
        cls, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, *, vocab_size: int,
        hidden_size: int, drafter: str,
    ) -> SharedVocab:  # fmt: skip
        """Detached views of the target's weights, refused unless both are [V, H]."""
        for name, w in (("embedding", embed_weight), ("LM head", lm_head_weight)):
            if tuple(w.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"target {name} has shape {tuple(w.shape)} but the {drafter} expects "
                    f"[{vocab_size}, {hidden_size}] (vocab_size x hidden_size); it was built "
                    "for a different target."
                )
        return cls(embed_weight.detach(), lm_head_weight.detach())


class DrafterHeads:
    """What every drafter over the target's vocabulary shares, whatever its backbone: the
    target's embedding and LM head (attached, never in state_dict), the sequential stage (U_k +
    the Markov bias B_k) and the confidence head. A subclass sets ``config``, ``markov_head``,
    ``confidence_head`` and ``shared`` and may override ``lm_head_input``."""

    drafter_name = "drafter"  # how errors about the shared vocab name it

    def attach_shared(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self.shared = SharedVocab.checked(
            embed_weight, lm_head_weight, vocab_size=self.config.vocab_size,
            hidden_size=self.config.hidden_size, drafter=self.drafter_name,
        )  # fmt: skip

    def _require_shared(self) -> SharedVocab:
        if self.shared is None:
            raise RuntimeError(
                "the drafter has no target embedding / LM head; call attach_shared() first"
            )
        return self.shared

    # ------------------------------------------------------------------ sequential stage
    def lm_head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the frozen LM head reads: h_k itself (V4 drafts normalise it first)."""
        return hidden

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U_k = lm_head_input(h_k) W_lm^T through the target's frozen LM head."""
        w = self._require_shared().lm_head_weight
        return F.linear(self.lm_head_input(hidden).to(w.dtype), w)

    def draft_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced U_k + B_k: prev_tokens [B, gamma] = (x_0=anchor, x_1, ..).
        The sum is the GEMM's accumulator (addmm: B_k + h_k W_lm^T in one pass over the
        [rows, V] output, 1.5x faster than a product and an add on a CPU)."""
        bias = self.markov_head.block_bias(prev_tokens, hidden)
        w = self._require_shared().lm_head_weight
        x = self.lm_head_input(hidden).to(w.dtype)
        if bias.dtype != w.dtype and not torch.is_autocast_enabled(bias.device.type):
            return F.linear(x, w) + bias  # mixed dtypes: the promoting add
        out = torch.addmm(bias.reshape(-1, bias.shape[-1]), x.reshape(-1, x.shape[-1]), w.t())
        return out.view(bias.shape)

    def confidence_logits(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor
    ) -> torch.Tensor | None:
        """Raw logits of c_k [B, gamma] (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        prev = self.markov_head.prev_embeddings(prev_tokens)
        return self.confidence_head(hidden, prev if self.confidence_head.with_markov else None)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What gets exported: everything but the (never registered) shared vocab."""
        return {k: v.detach() for k, v in self.state_dict().items()}


class DSparkDrafter(DrafterHeads, nn.Module):
    """Backbone + Markov head + confidence head; state_dict names are SGLang's."""

    def __init__(self, config: DSparkDraftConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.num_context_features * H, H, bias=False)  # W_c
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            [DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.markov_head: VanillaMarkov = build_markov_head(
            config.markov_head_type,
            vocab_size=config.vocab_size,
            markov_rank=config.markov_rank,
            hidden_size=H,
        )
        self.confidence_head: ConfidenceHead | None = (
            ConfidenceHead(
                hidden_size=H,
                markov_rank=config.markov_rank,
                with_markov=config.confidence_head_with_markov,
            )
            if config.enable_confidence_head
            else None
        )
        self.shared: SharedVocab | None = None  # plain attribute: never in state_dict

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self._require_shared().embed_weight)

    # ------------------------------------------------------------------ parallel stage
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c [H(l_1); ...; H(l_m)]); target_features [S, m*H]."""
        expected = self.fc.in_features
        if target_features.shape[-1] != expected:
            raise ValueError(
                f"target features have width {target_features.shape[-1]}, expected {expected} "
                f"({self.config.num_context_features} layers x {self.config.hidden_size})"
            )
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def forward(self, target_features: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """h_1..h_gamma of every block in ``layout`` (after the final norm): [B, gamma, H] for
        a packed layout (context [S, m*H]), [N, A, gamma, H] for a batched one ([N, S, m*H])."""
        batched = target_features.dim() == 3
        if batched != layout.batched:
            raise ValueError(
                "context [N, S, F] goes with a batched layout, [S, F] with a packed one"
            )
        if not batched:
            target_features, layout = target_features[None], layout.unsqueezed()
        ctx = self.project_context(target_features)
        j = torch.arange(ctx.shape[1], device=ctx.device)
        ctx_visible = (j >= layout.ctx_lo[..., None]) & (j < layout.ctx_hi[..., None])  # [N,A,S]
        x = self.embed(layout.block_ids).to(ctx.dtype)
        for layer in self.layers:
            x = layer(x, layout.positions, ctx, layout.ctx_positions, ctx_visible)
        x = self.norm(x)
        return x if batched else x[0]


@torch.no_grad()
def init_weights(drafter: DSparkDrafter, *, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic init: N(0, std) for matrices and embeddings, zeros for biases, ones for
    norms (the usual HF scheme). Uses its own generator: the global RNG is left alone."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)

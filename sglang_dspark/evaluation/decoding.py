"""Reference speculative decoding, batch 1, in plain PyTorch (gpt-fast style).

1. prefill: the target reads the prompt (HF ``DynamicCache``) and samples the first token,
   which becomes the anchor x_0 at position a; the target's features at ``target_layer_ids``
   are kept for every token whose KV is in the cache (positions 0..a-1).
2. draft: the block [x_0, mask x (gamma-1)] at positions a..a+gamma-1 attends to that context
   (strictly before the anchor, exactly as ``drafter/train.py`` builds it), and the Markov
   head samples x_1..x_gamma left to right (temperature 0: argmax; T: softmax(logits / T)).
   The confidence head gives c_1..c_gamma on the same prefix.
3. verify: ONE target forward over [x_0, x_1, .., x_gamma]; temperature 0 accepts the longest
   prefix equal to the target's argmax, temperature T > 0 runs
   ``rejection.chain_rejection_sample`` on softmax(logits / T) of both models. n drafts are
   accepted and the replacement / bonus token becomes the next anchor; the cache is cropped
   to a + n + 1 (anchor + n accepted tokens), whose features extend the context.
   tau = n + 1 tokens per round.

The MTP-1 baseline (`MtpProposer`) drafts one token per round from the target's final normed
hidden states (`CachedTarget(features="final")`), as SGLang's EAGLE worker hands them to a
draft with `use_aux_hidden_state: false`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sglang_dspark.drafter.markov_head import sample_block
from sglang_dspark.drafter.model import BlockLayout, DSparkDrafter
from sglang_dspark.drafter.mtp import MtpDrafter
from sglang_dspark.drafter.training.target import TargetAdapter
from sglang_dspark.verification.rejection import chain_rejection_sample


# ---------------------------------------------------------------------------- sampling
def logits_to_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Argmax at temperature 0, else one draw from softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(logits_to_probs(logits, temperature), 1, generator=generator))


# ---------------------------------------------------------------------------- target
class CachedTarget:
    """The target with a KV cache; each forward also returns the drafter's context features.

    ``features="layers"``: captured like :meth:`TargetAdapter.features` (output of decoder
    layer l for each l in ``target_layer_ids``, concatenated in order), only incrementally.
    ``features="final"``: the final normed hidden state (the LM head's input), for MTP-1.
    """

    def __init__(self, adapter: TargetAdapter, features: str = "layers") -> None:
        if features not in ("layers", "final"):
            raise ValueError(f"features must be 'layers' or 'final', got {features!r}")
        self.adapter = adapter
        self.features = features
        self.cache: Any = None

    @property
    def length(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.adapter.config)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (drops the rejected tail of a verify)."""
        drop = self.length - int(length)
        if drop > 0:  # a negative argument removes that many tokens (all HF versions)
            self.cache.crop(-drop)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``token_ids`` [n]: returns logits [n, V] (fp32) and context [n, m*H]."""
        captured: dict[int, torch.Tensor] = {}

        def hook(idx: int):
            def fn(_module, _inputs, output):
                captured[idx] = output[0] if isinstance(output, tuple) else output

            return fn

        if self.features == "final":
            points = {-1: self.adapter.base.norm}
        else:
            points = {i: self.adapter.layers[i] for i in self.adapter.target_layer_ids}
        handles = [m.register_forward_hook(hook(i)) for i, m in points.items()]
        try:
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            out = self.adapter.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        finally:
            for h in handles:
                h.remove()
        context = torch.cat([captured[i][0] for i in points], dim=-1)
        return out.logits[0].float(), context


# ---------------------------------------------------------------------------- drafting
@dataclass
class Proposal:
    """One drafted block: x_1..x_gamma, their logits U_k + B_k (p_d = softmax(logits / T)),
    and the raw confidence logits (c_k = sigmoid) or None without a confidence head."""

    tokens: torch.Tensor  # [gamma]
    logits: torch.Tensor  # [gamma, V]
    confidence_logits: torch.Tensor | None  # [gamma]


class Proposer(Protocol):
    gamma: int

    def propose(
        self,
        tokens: torch.Tensor,
        context: torch.Tensor,
        temperature: float,
        generator: torch.Generator,
    ) -> Proposal:
        """tokens [a+1]: the sequence up to the anchor x_0 = tokens[-1] (position a);
        context [a, m*H]: the target's features of tokens[:-1]."""
        ...


class DraftProposer:
    """The DSpark drafter: one parallel forward, then the Markov head left to right."""

    def __init__(self, drafter: DSparkDrafter) -> None:
        self.drafter = drafter.eval()
        self.gamma = drafter.config.block_size

    @torch.inference_mode()
    def propose(
        self,
        tokens: torch.Tensor,
        context: torch.Tensor,
        temperature: float,
        generator: torch.Generator,
    ) -> Proposal:
        d, g = self.drafter, self.gamma
        a = tokens.numel() - 1  # anchor position; context rows are positions 0..a-1
        if context.shape[0] != a:
            raise ValueError(f"context has {context.shape[0]} rows for an anchor at {a}")
        block = torch.full((1, g), d.config.mask_token_id, dtype=torch.long)
        block[0, 0] = tokens[-1]  # [anchor, mask x (gamma-1)]
        layout = BlockLayout(
            block_ids=block,
            positions=a + torch.arange(g)[None],
            ctx_positions=torch.arange(a),
            ctx_lo=torch.zeros(1, dtype=torch.long),
            ctx_hi=torch.tensor([a]),  # strictly before the anchor
        )
        hidden = d(context, layout)  # h_1..h_gamma [1, g, H]
        drafts, logits = sample_block(
            d.markov_head,
            d.base_logits(hidden),
            hidden,
            block[:, 0],
            temperature=temperature,
            generator=generator,
        )
        prev = torch.cat([block[:, :1], drafts[:, :-1]], dim=1)  # x_0..x_{gamma-1}
        conf = d.confidence_logits(hidden, prev)
        return Proposal(drafts[0], logits[0], None if conf is None else conf[0].float())


class MtpProposer:
    """The MTP-1 baseline: one NextN step over rows (h_t, x_{t+1}), t = 0..a-1, whose last
    row (h_{a-1}, x_0) drafts x_1. The layer re-reads the whole prefix each round (no draft
    KV cache): the reference is slow but exact, and only its acceptance is measured."""

    gamma = 1

    def __init__(self, drafter: MtpDrafter) -> None:
        self.drafter = drafter.eval()

    @torch.inference_mode()
    def propose(
        self,
        tokens: torch.Tensor,
        context: torch.Tensor,
        temperature: float,
        generator: torch.Generator,
    ) -> Proposal:
        a = tokens.numel() - 1
        if context.shape[0] != a or a < 1:
            raise ValueError(f"context has {context.shape[0]} rows for an anchor at {a}")
        out = self.drafter(context, tokens[1:], torch.arange(a))
        logits = self.drafter.logits(out[-1:]).float()  # [1, V]
        draft = sample(logits[0], temperature, generator)
        return Proposal(torch.tensor([draft], dtype=torch.long), logits, None)


# ---------------------------------------------------------------------------- verification
Verifier = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Generator], tuple[int, int]
]


def verify_block(
    drafts: torch.Tensor,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
) -> tuple[int, int]:
    """(n accepted drafts, next token) from drafts [g], target logits [g+1, V] (rows: after
    x_0..x_g) and draft logits [g, V]. Temperature 0: greedy prefix match, next = argmax."""
    if temperature <= 0:
        greedy = target_logits.argmax(-1)
        n = int((drafts == greedy[:-1]).int().cumprod(0).sum())
        return n, int(greedy[n])
    p_t = logits_to_probs(target_logits, temperature)[None]
    p_d = logits_to_probs(draft_logits, temperature)[None]
    n, nxt = chain_rejection_sample(drafts[None], p_t, p_d, generator=generator)
    return int(n[0]), int(nxt[0])


# ---------------------------------------------------------------------------- the loop
@dataclass
class Round:
    accepted: int  # n in 0..gamma; tau = n + 1
    confidence_logits: list[float] | None  # raw logits of c_1..c_gamma


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (the first one from prefill), EOS included
    rounds: list[Round]
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0


def _finish(out: list[int], new: Iterable[int], eos: set[int], max_new: int) -> bool:
    """Append ``new`` to ``out`` up to EOS / ``max_new``; True when generation is over."""
    for t in new:
        out.append(int(t))
        if int(t) in eos or len(out) >= max_new:
            return True
    return False


@torch.inference_mode()
def speculative_generate(
    target: CachedTarget,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_token_ids: Iterable[int] = (),
    verify: Verifier = verify_block,
) -> Generation:
    """Reference speculative decoding of one prompt (see the module docstring)."""
    eos, g = set(eos_token_ids), proposer.gamma
    max_pos = int(getattr(target.adapter.config, "max_position_embeddings", 1 << 30))
    t0 = time.perf_counter()
    target.reset()
    logits, context = target.forward(prompt_ids)  # features of every prompt token
    anchor = sample(logits[-1], temperature, generator)
    gen = Generation(tokens=[], rounds=[], prefill_s=time.perf_counter() - t0)
    seq = torch.tensor([*prompt_ids, anchor], dtype=torch.long)
    done = _finish(gen.tokens, [anchor], eos, max_new_tokens)
    while not done and seq.numel() + g <= max_pos:
        a = seq.numel() - 1  # anchor position == target.length == context rows
        t1 = time.perf_counter()
        prop = proposer.propose(seq, context, temperature, generator)
        t2 = time.perf_counter()
        t_logits, t_context = target.forward([anchor, *prop.tokens.tolist()])
        n, nxt = verify(prop.tokens, t_logits, prop.logits, temperature, generator)
        target.crop(a + n + 1)  # anchor + n accepted drafts; the next anchor is not in yet
        context = torch.cat([context, t_context[: n + 1]])
        gen.draft_s += t2 - t1
        gen.verify_s += time.perf_counter() - t2
        conf = prop.confidence_logits
        gen.rounds.append(Round(n, None if conf is None else conf.tolist()))
        new = [*prop.tokens[:n].tolist(), nxt]
        seq = torch.cat([seq, torch.tensor(new, dtype=torch.long)])
        anchor = nxt
        done = _finish(gen.tokens, new, eos, max_new_tokens)
    gen.wall_s = time.perf_counter() - t0
    return gen


@torch.inference_mode()
def target_generate(
    target: CachedTarget,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_token_ids: Iterable[int] = (),
) -> Generation:
    """Plain autoregressive decoding with the target alone (baseline and test reference)."""
    eos = set(eos_token_ids)
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt_ids)
    gen = Generation(tokens=[], rounds=[])
    while True:
        tok = sample(logits[-1], temperature, generator)
        if _finish(gen.tokens, [tok], eos, max_new_tokens):
            break
        logits, _ = target.forward([tok])
    gen.wall_s = time.perf_counter() - t0
    return gen

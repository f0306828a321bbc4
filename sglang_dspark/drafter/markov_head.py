"""DSpark's sequential stage: a prefix-dependent bias B_k added to the base logits U_k.

    p_k(v | x_0, x_<k) = softmax_v( U_k(v) + B_k(x_0, x_<k, v) )

- vanilla (default): B = W1[x_{k-1}] W2,                  W1 in R^{V x r}, W2 in R^{r x V}
- gated (DeepSpec):  B = (sigmoid(W_g [h_k; W1[x_{k-1}]]) * W1[x_{k-1}]) W2
- rnn:  z_k = [s_{k-1}; W1[x_{k-1}]; h_k],  [g; c; o] = W_joint z_k,
        s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c),  B_k = W2 tanh(o),  s_0 = 0

x_0 is the anchor. Parameter names and shapes are SGLang's (``srt/models/dspark.py``):
``markov_w1`` (an Embedding, [V, r]), ``markov_w2`` (a Linear r -> V, weight [V, r]),
``gate_proj`` ([r, H + r] + bias), ``joint_proj`` ([3r, 2r + H] + bias).
"""

from __future__ import annotations

import torch
from torch import nn


class VanillaMarkov(nn.Module):
    """First-order Markov bias B(x_{k-1}, .) = W1[x_{k-1}] W2."""

    head_type = "vanilla"

    def __init__(self, *, vocab_size: int, markov_rank: int) -> None:
        super().__init__()
        if markov_rank <= 0:
            raise ValueError(f"a Markov head needs markov_rank > 0, got {markov_rank}")
        self.vocab_size = int(vocab_size)
        self.markov_rank = int(markov_rank)
        self.markov_w1 = nn.Embedding(self.vocab_size, self.markov_rank)  # W1
        self.markov_w2 = nn.Linear(self.markov_rank, self.vocab_size, bias=False)  # W2

    def prev_embeddings(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [..., r]. Also the confidence head's Markov feature."""
        return self.markov_w1(prev_tokens.long())

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    def code(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step's rank-r code z_k, with B_k = W2 z_k (and the next state)."""
        return self.prev_embeddings(prev_tokens), state

    def step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: B_k [..., V] from x_{k-1} (and h_k / s_{k-1} for gated / rnn)."""
        z, state = self.code(prev_tokens, hidden, state)
        return self.markov_w2(z), state

    def block_codes(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced z_1..z_gamma [..., gamma, r] (B_k = W2 z_k) for whole blocks."""
        return self.code(prev_tokens, hidden, None)[0]

    def block_bias(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced B_1..B_gamma for whole blocks.

        prev_tokens [..., gamma] = (x_0, x_1, ..., x_{gamma-1}) (x_0 the anchor),
        hidden [..., gamma, H] = h_1..h_gamma. Returns [..., gamma, V].
        Position k depends on the prefix only through x_{k-1} (and s_{k-1} for rnn).
        """
        bias, _ = self.step(prev_tokens, hidden, None)
        return bias


class GatedMarkovHead(VanillaMarkov):
    """B = (sigmoid(W_g [h_k; W1[x_{k-1}]]) * W1[x_{k-1}]) W2."""

    head_type = "gated"

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank)
        self.gate_proj = nn.Linear(int(hidden_size) + self.markov_rank, self.markov_rank)  # W_g

    def code(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        e = self.prev_embeddings(prev_tokens)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(e.dtype), e], dim=-1)))
        return gate * e, state


class RNNHead(VanillaMarkov):
    """Gated recurrent state over the block: B_k sees the whole prefix through s_{k-1}."""

    head_type = "rnn"

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank)
        r = self.markov_rank
        self.joint_proj = nn.Linear(2 * r + int(hidden_size), 3 * r)  # [W_g; W_c; W_o]

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """s_0 = 0, one per row of ``hidden`` [..., H]."""
        return hidden.new_zeros(*hidden.shape[:-1], self.markov_rank)

    def code(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.prev_embeddings(prev_tokens)
        if state is None:
            state = self.init_state(hidden).to(e.dtype)
        z = torch.cat([state.to(e.dtype), e, hidden.to(e.dtype)], dim=-1)
        g, c, o = self.joint_proj(z).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        new_state = g * state + (1.0 - g) * torch.tanh(c)
        return torch.tanh(o), new_state

    def block_codes(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        state = self.init_state(hidden[..., 0, :])
        codes = []
        for k in range(prev_tokens.shape[-1]):
            z, state = self.code(prev_tokens[..., k], hidden[..., k, :], state)
            codes.append(z)
        return torch.stack(codes, dim=-2)

    def block_bias(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.block_codes(prev_tokens, hidden))


def build_markov_head(
    head_type: str, *, vocab_size: int, markov_rank: int, hidden_size: int
) -> VanillaMarkov:
    head_type = str(head_type).lower()
    if head_type == "vanilla":
        return VanillaMarkov(vocab_size=vocab_size, markov_rank=markov_rank)
    if head_type == "gated":
        return GatedMarkovHead(
            vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size
        )
    if head_type == "rnn":
        return RNNHead(vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size)
    raise ValueError(f"markov_head_type {head_type!r} is not one of vanilla, gated, rnn")


@torch.no_grad()
def sample_block(
    head: VanillaMarkov,
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-to-right sampling of one block per row (the serving-time sequential stage).

    base_logits [B, gamma, V] = U_1..U_gamma, hidden [B, gamma, H] = h_1..h_gamma,
    anchor [B] = x_0. Returns (tokens [B, gamma], step logits U_k + B_k [B, gamma, V]).
    temperature 0 takes the argmax.
    """
    prev = anchor.long()
    state = head.init_state(hidden[:, 0])
    tokens, logits = [], []
    for k in range(base_logits.shape[1]):
        bias, state = head.step(prev, hidden[:, k], state)
        step_logits = base_logits[:, k].float() + bias.float()
        if temperature <= 0:
            prev = step_logits.argmax(dim=-1)
        else:
            probs = torch.softmax(step_logits / temperature, dim=-1)
            prev = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens.append(prev)
        logits.append(step_logits)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)

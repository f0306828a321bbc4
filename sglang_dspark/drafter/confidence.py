"""Confidence head: c_k = sigmoid( w^T [h_k; W1[x_{k-1}]] ).

c_k estimates the probability that draft token k survives verification given that tokens
1..k-1 did. It is trained against the soft label c*_k = 1 - 0.5 ||p_d,k - p_t,k||_1 (see
``loss.py``); at serving time SGLang applies STS temperatures to the raw logit.
Parameter names are SGLang's: ``confidence_head.proj.{weight [1, H (+ r)], bias [1]}``.
"""

from __future__ import annotations

import torch
from torch import nn


class ConfidenceHead(nn.Module):
    def __init__(self, *, hidden_size: int, markov_rank: int, with_markov: bool = True) -> None:
        super().__init__()
        self.with_markov = bool(with_markov)
        in_dim = int(hidden_size) + (int(markov_rank) if self.with_markov else 0)
        self.proj = nn.Linear(in_dim, 1, bias=True)  # w (and a bias)

    def forward(
        self, hidden: torch.Tensor, prev_embeddings: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Raw logit of c_k: hidden [..., H] = h_k, prev_embeddings [..., r] = W1[x_{k-1}]."""
        if self.with_markov:
            if prev_embeddings is None:
                raise ValueError("this confidence head reads W1[x_{k-1}]; pass prev_embeddings")
            features = torch.cat([hidden, prev_embeddings.to(hidden.dtype)], dim=-1)
        else:
            features = hidden
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)

"""The CPU Markov sampling step of a DSPARK draft, without SGLang's torch Philox.

SGLang's torch path of the Markov sampling step (`MarkovSampleStep.torch`, the CPU driver)
samples a row as the argmax of its step logits over the temperature plus Gumbel noise, the
noise from a Philox4x32-10 keyed like the Triton kernel's (`tl.philox`), written out in torch:
ten rounds of 64-bit multiplies, shifts and xors over a quarter of the vocabulary per row.
That is what the Triton kernel does in registers; in torch on CPU it is about 40 elementwise
passes per round and dominates the draft pass (2.7 ms per row and step against 0.3 ms for the
rest of the step, 49152 words; a DSPARK block has seven steps).

Two hooks, both on CPU tensors only (a CUDA tensor, or a vocabulary sharded over ranks, leaves
the call unchanged):

- `cpu_greedy_markov_step`: the torch path draws the noise for every row whenever the step
  logits are kept (`has_sampled_rows=None`), because reading the temperatures on the host
  would break a CUDA graph capture. On CPU there is no graph and no device sync, so when every
  row's temperature is 0 we say so (`has_sampled_rows=False`): the tokens and the kept step
  logits are identical (about 14% of a greedy decode round, py-spy).
- `cpu_sampled_markov_step`: rows at a temperature above 0 draw their token by inverting the
  cumulative distribution of softmax(step logits / temperature) (float64 running sum) at one
  uniform from torch's CPU generator, seeded from the same (key, block offset, step) that keys
  the Philox stream. The token's distribution is the same categorical the Gumbel argmax draws
  from, the kept step logits (the proposal the verifier reads) are unchanged, and greedy rows
  keep the argmax, so verification stays exact; only the random stream differs from the CUDA
  kernel's, as it may (neither is tied to a request's seed).
"""

from __future__ import annotations

import torch

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.kernels.ops.speculative.dspark.markov_sample.MarkovSampleStep.torch"

_MASK64 = (1 << 64) - 1


def _greedy_rows(original, cls, **kwargs):
    temperatures = kwargs.get("temperatures")
    if (
        kwargs.get("has_sampled_rows") is None
        and temperatures is not None
        and temperatures.device.type == "cpu"
        and not bool((temperatures != 0).any())
    ):
        kwargs["has_sampled_rows"] = False
    return original(cls, **kwargs)


def stream_seed(key: int, offset: int, step: int) -> int:
    """A seed for torch's CPU generator from the draft noise's Philox coordinates (Python's
    tuple hash of ints: the same in every process, unrelated for neighbouring offsets)."""
    return hash((key, offset, step)) & _MASK64


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of `logits` ([rows, width], float32) from softmax(logits / t), by
    inverse CDF at a uniform drawn from a generator seeded with `seed`."""
    scaled = logits / temperatures[:, None]
    weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()  # unnormalised softmax
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(len(logits), 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)


def _sampled_rows(original, cls, **kwargs):
    temperatures = kwargs.get("temperatures")
    logits_out = kwargs.get("logits_out")
    if (
        kwargs.get("has_sampled_rows") is False
        or temperatures is None
        or temperatures.device.type != "cpu"
        or kwargs["base_logits"].device.type != "cpu"
        or kwargs.get("gather") is not None
        or logits_out is None
    ):
        return original(cls, **kwargs)
    # the upstream step without noise: the kept step logits, and the argmax for greedy rows
    tokens = original(cls, **{**kwargs, "has_sampled_rows": False})
    sampled = (temperatures != 0).nonzero()[:, 0]
    if not len(sampled):
        return tokens
    width = kwargs["bias"].shape[1]
    logits = logits_out[sampled, :width].float()
    if bool(logits.isnan().any()):  # upstream's NaN rule (lowest NaN index) is the kernel's
        return original(cls, **kwargs)
    seed = stream_seed(int(kwargs["key"]), int(kwargs["offset"].item()), int(kwargs["step"]))
    picked = sample_rows(logits, temperatures[sampled], seed)
    tokens[sampled] = picked + int(kwargs.get("vocab_start", 0))
    return tokens


def install_greedy() -> None:
    register_around(TARGET, _greedy_rows)


def install_sampled() -> None:
    register_around(TARGET, _sampled_rows)


HOOKS = {"cpu_greedy_markov_step": install_greedy, "cpu_sampled_markov_step": install_sampled}

"""`cpu_greedy_markov_step`: no Philox noise for an all-greedy draft step on CPU.

SGLang's torch path of the Markov sampling step (`MarkovSampleStep.torch`, the CPU driver)
draws Gumbel noise for the whole vocabulary of every row whenever the step logits are kept
(`has_sampled_rows=None`), because reading the temperatures on the host would break a CUDA
graph capture. Greedy rows then throw that noise away. On CPU there is no graph and no device
sync, so when every row's temperature is 0 we say so (`has_sampled_rows=False`): the tokens
and the kept step logits are identical, and the step no longer runs a 10-round Philox over
49152 columns seven times per round (about 14% of a DSPARK decode round on the embedded
default, py-spy). Any sampled row, or a CUDA tensor, leaves the call unchanged.
"""

from __future__ import annotations

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.kernels.ops.speculative.dspark.markov_sample.MarkovSampleStep.torch"


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


def install() -> None:
    register_around(TARGET, _greedy_rows)


HOOKS = {"cpu_greedy_markov_step": install}

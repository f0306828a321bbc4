"""`v4_cpu_plain_rope`: DeepSeek-V4's sliding-window layers get a RoPE on CPU.

`MQALayer` asks for its RoPE with `rope_scaling=None` on layers with `compress_ratio == 0`
(sliding window only; `models/deepseek_v4.py:1391`), whatever the config says: those layers
use plain RoPE at `rope_theta`. On CPU, `get_rope_wrapper` hands that to `get_rope_cpu`, which
knows only `deepseek_yarn` and asserts on None (`layers/rotary_embedding/factory.py:478`), so a
V4 model cannot even be built on CPU.

The hook maps a None scaling on CPU to `deepseek_yarn` with factor 1 and
`original_max_position_embeddings = max_position`: YaRN's interpolation ramp divides by the
factor and its mscale is 1 at factor 1, so those are exactly the plain RoPE frequencies
(`DeepseekScalingRotaryEmbedding`). `get_rope_cpu` is called only for the CPU device.
"""

from __future__ import annotations

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.srt.layers.rotary_embedding.factory.get_rope_cpu"


def plain_rope_scaling(max_position: int) -> dict:
    """The `deepseek_yarn` scaling that is plain RoPE (factor 1, no interpolation)."""
    return {
        "rope_type": "deepseek_yarn",
        "factor": 1.0,
        "original_max_position_embeddings": max_position,
    }


def _plain_rope_as_yarn(
    original, head_size, rotary_dim, max_position, base, is_neox_style=True,
    rope_scaling=None, *args, **kwargs,
):  # fmt: skip
    if rope_scaling is None:
        rope_scaling = plain_rope_scaling(max_position)
    return original(
        head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, *args, **kwargs
    )


def install() -> None:
    register_around(TARGET, _plain_rope_as_yarn)


HOOKS = {"v4_cpu_plain_rope": install}

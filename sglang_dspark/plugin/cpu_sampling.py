"""`cpu_rejection_sampler`: lossless DSPARK verification at temperature > 0 on CPU.

SGLang's DSPARK accept path (`dspark_accept._accept_sampling_core`) always calls the Triton
kernel `chain_speculative_sampling_triton`, which has no CPU driver. We swap in
`sglang_dspark.rejection.chain_speculative_sampling_torch` (same signature, buffers and random
coins) for CPU tensors; CUDA tensors keep the Triton kernel.

`SGLANG_DSPARK_TEST_BREAK_SAMPLER=MODE` (tests only) breaks the sampler on purpose, so the
losslessness tests and `sglang-dspark audit` can show that they catch a broken server. Modes
(`sglang_dspark.rejection.BROKEN_MODES`): `accept_all` (every draft kept), `no_renorm` (the
replacement drawn from max(0, p_t - p_d) without renormalising), `bonus_from_draft` (the bonus
token from the last draft distribution), `ratio_scaled[:C]` (acceptance ratio times C, 1.3 by
default). An unknown mode raises at the first verification.

`SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE=PATH` (tests only) reads the mode from PATH at every
verification instead (missing or empty file: the honest sampler), so one running server can be
sampled honest and then broken, without a second start-up.
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.kernels.ops.speculative.dspark.dspark_accept.chain_speculative_sampling_triton"


def broken_sampler_mode() -> str | None:
    """SGLANG_DSPARK_TEST_BREAK_SAMPLER (or the mode in SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE,
    read now), validated (ValueError names the valid modes)."""
    from sglang_dspark.rejection import parse_broken_mode

    mode = os.environ.get("SGLANG_DSPARK_TEST_BREAK_SAMPLER") or None
    path = os.environ.get("SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE")
    if path:
        try:
            mode = Path(path).read_text().strip() or None
        except FileNotFoundError:
            mode = None
    parse_broken_mode(mode)
    return mode


def _dispatch(original, *args, **kwargs):
    from sglang_dspark.rejection import chain_speculative_sampling_torch

    candidates = kwargs.get("candidates", args[3] if len(args) > 3 else None)
    if candidates is not None and candidates.device.type == "cpu":
        return chain_speculative_sampling_torch(*args, **kwargs, broken=broken_sampler_mode())
    return original(*args, **kwargs)


def install() -> None:
    register_around(TARGET, _dispatch)


HOOKS = {"cpu_rejection_sampler": install}

"""`cpu_rejection_sampler`: lossless DSPARK verification at temperature > 0 on CPU.

SGLang's DSPARK accept path (`dspark_accept._accept_sampling_core`) always calls the Triton
kernel `chain_speculative_sampling_triton`, which has no CPU driver. We swap in
`sglang_dspark.rejection.chain_speculative_sampling_torch` (same signature, buffers and random
coins) for CPU tensors; CUDA tensors keep the Triton kernel.

`SGLANG_DSPARK_TEST_BREAK_SAMPLER=accept_all` (tests only) makes the sampler keep every draft
token, so the losslessness tests and `sglang-dspark audit` can show that they catch a broken
server.
"""

from __future__ import annotations

import os

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.kernels.ops.speculative.dspark.dspark_accept.chain_speculative_sampling_triton"


def _dispatch(original, *args, **kwargs):
    from sglang_dspark.rejection import chain_speculative_sampling_torch

    candidates = kwargs.get("candidates", args[3] if len(args) > 3 else None)
    if candidates is not None and candidates.device.type == "cpu":
        broken = os.environ.get("SGLANG_DSPARK_TEST_BREAK_SAMPLER") == "accept_all"
        return chain_speculative_sampling_torch(*args, **kwargs, accept_all=broken)
    return original(*args, **kwargs)


def install() -> None:
    register_around(TARGET, _dispatch)


HOOKS = {"cpu_rejection_sampler": install}

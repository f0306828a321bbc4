"""`cpu_rejection_sampler`: lossless DSPARK verification at temperature > 0 on CPU.

SGLang's DSPARK accept path (`dspark_accept._accept_sampling_core`) always calls the Triton
kernel `chain_speculative_sampling_triton`, which has no CPU driver. We swap in
`sglang_dspark.verification.rejection.chain_speculative_sampling_torch` (same signature, buffers and random
coins) for CPU tensors; CUDA tensors keep the Triton kernel.

The negative controls of the losslessness tests (a sampler broken on purpose) are not here:
a test-only SGLang plugin (tests/controls/dspark_test_controls.py) installs them in test
servers. This sampler reads no test variable.
"""

from __future__ import annotations

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.kernels.ops.speculative.dspark.dspark_accept.chain_speculative_sampling_triton"


def _dispatch(original, *args, **kwargs):
    from sglang_dspark.verification.rejection import chain_speculative_sampling_torch

    candidates = kwargs.get("candidates", args[3] if len(args) > 3 else None)
    if candidates is not None and candidates.device.type == "cpu":
        return chain_speculative_sampling_torch(*args, **kwargs)
    return original(*args, **kwargs)


def install() -> None:
    register_around(TARGET, _dispatch)


HOOKS = {"cpu_rejection_sampler": install}

"""`cpu_paged_last_loc`: the paged allocator's last-slot lookup in torch on CPU.

With a page size above 1 the allocator asks for each request's last KV slot before it extends
the request (`get_last_loc`, `mem_cache/allocation.py:139`); for any attention backend other
than `torch_native` / `ascend` it takes the Triton kernel `get_last_loc_triton`
(`kernels/ops/memory/common.py:144`), which fails on CPU ("0 active drivers"). DeepSeek-V4
pages by 256 tokens with its `dsv4` backend; a DSPARK decode step allocates its verify
window through this lookup (`alloc_for_spec_decode`, `allocation.py:804`).

On CPU tensors the hook answers with SGLang's own torch version, `get_last_loc_torch`
(`allocation.py:147`: `req_to_token[req, prefix_len - 1]`, -1 for an empty prefix), in the
prefix lengths' dtype as the kernel writes it.
"""

from __future__ import annotations

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.kernels.ops.memory.common.get_last_loc_triton"


def _last_loc(original, req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
    if prefix_lens_tensor.device.type != "cpu":
        return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    last = get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    return last.to(prefix_lens_tensor.dtype)


def install() -> None:
    register_around(TARGET, _last_loc)


HOOKS = {"cpu_paged_last_loc": install}

"""`v4_cpu_fp8_kv_pool`: DeepSeek-V4's own fp8 KV pool is allowed on CPU.

V4 sets `kv_cache_dtype=fp8_e4m3` (`arg_groups/overrides.py`, `_deepseek_v4_kv_cache_dtype`)
and keeps its KV in `DeepSeekV4TokenToKVPool`: 584-byte rows (448 e4m3 + 64 bf16 + scales)
that the `dsv4` attention backend reads itself. `KVCacheConfigurator.configure` refuses every
fp8 KV cache on CPU unless the CPU has Intel AMX and the attention backend is `intel_amx`
(`mem_cache/kv_cache_configurator.py:459-468`). That guard is for the generic MHA pools that
the CPU attention kernels read; it does not concern V4's pool.

For a DeepSeek-V4 model on CPU with an fp8 KV cache, the hook runs `configure` without that
guard (the rest of the body is upstream's, line for line). Every other model, dtype or device
goes through upstream's `configure` unchanged.
"""

from __future__ import annotations

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure"


def is_v4_fp8_on_cpu(configurator) -> bool:
    import torch
    from sglang.srt.configs.model_config import is_deepseek_v4
    from sglang.srt.platforms import current_platform

    return (
        current_platform.is_cpu()
        and configurator.kv_cache_dtype == torch.float8_e4m3fn
        and is_deepseek_v4(configurator.model_config.hf_config)
    )


def _configure_without_cpu_fp8_guard(self, *, pre_model_load_memory: int):
    """Upstream 0.5.23's `KVCacheConfigurator.configure` after its CPU fp8 guard."""
    from sglang.srt.mem_cache import kv_cache_configurator as kvc

    if not self.spec_algorithm.is_none() and self.is_draft_worker:
        assert self.memory_pool_config is not None, "Draft worker requires memory_pool_config"
        config = self.memory_pool_config
    else:
        config = self._resolve_memory_pool_config(pre_model_load_memory)
    sizes = self._derive_pool_sizes(config=config)
    pools = self._init_pools(
        sizes=sizes,
        req_to_token_pool=self.req_to_token_pool,
        token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
    )
    swa_max_total_num_tokens = sizes.swa_max_total_num_tokens
    alloc = pools.token_to_kv_pool_allocator
    if not self.is_draft_worker and kvc.is_swa_req_ring(alloc):
        swa_max_total_num_tokens = alloc.size_swa
    kvc.logger.info(
        "Memory pool end. avail mem="
        f"{kvc.get_available_gpu_memory(self.device, self.gpu_id):.2f} GB"
    )
    return kvc.KVCacheConfigResult(
        max_total_num_tokens=sizes.max_total_num_tokens,
        max_running_requests=sizes.max_running_requests,
        full_max_total_num_tokens=sizes.full_max_total_num_tokens,
        swa_max_total_num_tokens=swa_max_total_num_tokens,
        req_to_token_pool=pools.req_to_token_pool,
        token_to_kv_pool=pools.token_to_kv_pool,
        token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator,
        memory_pool_config=config,
        unified_memory_pool=pools.unified_memory_pool,
    )


def _configure(original, self, *, pre_model_load_memory: int):
    if is_v4_fp8_on_cpu(self):
        return _configure_without_cpu_fp8_guard(self, pre_model_load_memory=pre_model_load_memory)
    return original(self, pre_model_load_memory=pre_model_load_memory)


def install() -> None:
    register_around(TARGET, _configure)


HOOKS = {"v4_cpu_fp8_kv_pool": install}

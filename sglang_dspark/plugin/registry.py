"""How every hook registers with SGLang's HookRegistry, and the checks that make it fail loudly.

Hook modules call `register_replace/around/before/after(target, fn)`. While `install_checked`
runs a hook's `install()`, those calls are recorded, so that for every hook we know the SGLang
targets it changes. Then, per hook (one failing hook never hides another):

1. `install()` itself must not raise;
2. every target must resolve (an upstream rename fails here, not at the first request) and its
   `inspect.signature` must equal the one recorded below in `UPSTREAM_SIGNATURES`, the
   signature of SGLang 0.5.23's function that the hook was written against (a new keyword
   would otherwise be a TypeError inside the scheduler loop);
3. after `HookRegistry.apply_hooks()`, every target must really be patched (SGLang logs a
   failed application and carries on), and the hooks that change SGLang without the registry
   (`APPLIED_CHECKS`) must show their change.

Adding a hook target means adding its signature to `UPSTREAM_SIGNATURES`: the refusal names
the target and prints the live signature to copy.
"""

from __future__ import annotations

import contextvars
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

# target -> its signature in SGLang 0.5.23, as `signature_text` prints it (annotations left
# out). None: the target must only resolve (sgl-kernel CPU ops, which are patch 0001's
# `(*args, **kwargs)` placeholders here and compiled ops without a Python signature on a
# machine with sgl-kernel's CPU build; plain attributes a hook assigns; code a hook's applied
# check only reads).
UPSTREAM_SIGNATURES: dict[str, str | None] = {
    # cpu_sgl_kernel_ops
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_cpu": None,
    "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_cpu": None,
    "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_cpu": None,
    "sglang.kernels.ops.speculative.eagle.fill_bonus_tokens_cpu": None,
    "sglang.kernels.ops.speculative.eagle.fill_accept_out_cache_loc_cpu": None,
    "sglang.kernels.ops.kvcache.cache_move.copy_all_layer_kv_cache_cpu": None,
    # cpu_scheduler_malloc_trim
    "sglang.srt.managers.scheduler.Scheduler.run_event_loop": "(self)",
    # cpu_engine_for_device_cpu, cpu_onednn_caches
    "sglang.srt.arg_groups.platform_hook.handle_cpu_backends": "(server_args)",
    "sglang.srt.utils.common.is_cpu": "()",
    "sglang.srt.arg_groups.overrides.resolving_view": "(server_args)",
    # dspark_cpu_device_gate, dspark_draft_validation, dspark_scheduler_mode
    "sglang.srt.arg_groups.speculative_hook._handle_dspark": "(server_args)",
    "sglang.srt.arg_groups.speculative_hook.resolving_view": "(server_args)",
    # torch_native_draft_backend
    "sglang.srt.arg_groups.choices.DRAFT_ATTENTION_BACKEND_CHOICES": None,
    "sglang.srt.arg_groups.choices.add_draft_attention_backend_choices": "(iterable, /)",
    # cpu_record_stream_noop
    "torch.Tensor.record_stream": None,
    # cpu_bf16_draft_kernels
    "sglang.srt.models.dspark.DSparkDraftMixin._fused_kv_write_bundle": "(self, pool)",
    "sglang.srt.models.dflash.DFlashAttention.__init__": (
        "(self, config, layer_id, quant_config=None, prefix='')"
    ),
    # eagle_cpu_chain_only
    "sglang.srt.arg_groups.speculative_hook._handle_eagle_family": "(server_args)",
    # eagle_torch_native_draft_extend
    "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend": (
        "(self, backend_name, backend_map, error_template, stamps_children=False)"
    ),
    # cpu_eagle_tree_ops
    "sglang.kernels.ops.speculative.spec_tree.sgl_build_tree_kernel_efficient_cpu": None,
    "sglang.kernels.ops.speculative.spec_tree.sgl_verify_tree_greedy_cpu": None,
    # cpu_eagle_sampling_verify
    "sglang.srt.speculative.eagle_utils._verify_uses_greedy": (
        "(*, is_all_greedy, is_cpu, is_hip, is_xpu, use_rejection_sampling)"
    ),
    "sglang.srt.speculative.eagle_utils.tree_speculative_sampling_target_only": None,
    "sglang.srt.speculative.eagle_utils.top_k_renorm_prob": None,
    "sglang.srt.speculative.eagle_utils.top_p_renorm_prob": None,
    # cpu_half_gemm_fp32
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply": (
        "(self, layer, x, bias=None)"
    ),
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head": (
        "(self, hidden_states, lm_head, embedding_bias=None, *, out=None)"
    ),
    # cpu_row_argmax
    "sglang.srt.speculative.spec_utils.row_argmax": "(x)",
    # torch_native_target_verify
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend": (
        "(self, q, k, v, layer, forward_batch, save_kv_cache=True)"
    ),
    # cpu_greedy_markov_step, cpu_sampled_markov_step
    "sglang.kernels.ops.speculative.dspark.markov_sample.MarkovSampleStep.torch": (
        "(cls, *, base_logits, bias, temperatures, key, offset, step, step_dtype, vocab_start=0, "
        "gather=None, gather_logits=None, logits_out=None, has_sampled_rows=None)"
    ),
    # cpu_rejection_sampler
    "sglang.kernels.ops.speculative.dspark.dspark_accept.chain_speculative_sampling_triton": (
        "(predicts, accept_index, accept_token_num, candidates, retrive_index, "
        "retrive_next_token, retrive_next_sibling, uniform_samples, "
        "uniform_samples_for_final_sampling, target_probs, draft_probs, threshold_single, "
        "threshold_acc, deterministic, *, block_verification=False)"
    ),
    # cpu_verified_rows_accept
    "sglang.srt.speculative.dspark_components.dspark_verify.accept_draft_tokens": (
        "(*, candidates, target_logits, draft_block, sampling_info, draft_input, gamma, "
        "verify_num_draft_tokens, cutoff_layout=None, fused_argmax=False, "
        "block_verification=False, rejection_noise=None)"
    ),
    # cpu_draft_until_verifiable
    "sglang.srt.speculative.dspark_components.dspark_draft.DraftBlockProposer.propose": (
        "(self, *, batch, draft_input, verify_window, bs, device, target_model, sampling_info, "
        "anchor_prepared=False)"
    ),
    "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2.__init__": (
        "(self, server_args, gpu_id, nccl_port, target_worker, "
        "draft_worker_cls=<class 'sglang.srt.managers.tp_worker.TpModelWorker'>)"
    ),
    # cpu_plain_rounds
    "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2._forward_decode": (
        "(self, batch, on_publish, grammar_barrier=None, coordination_plan=None)"
    ),
    # dspark_sync_scheduler
    "sglang.srt.speculative.dspark_components.dspark_planner.HostConfidenceBudgetPlanner"
    ".compute_budget": (
        "(self, *, confidence, generation, current_generation, req_pool_indices_cpu)"
    ),
    "sglang.srt.speculative.dspark_components.dspark_planner.DSparkVerifyPlanner"
    ".compute_budget_sync": "(self, *, confidence, prefix_lens, req_pool_indices)",
    "sglang.kernels.ops.speculative.dspark.dspark_schedule.ScheduleVerifyLensTopk.execute": (
        "(cls, *args, **kwargs)"
    ),
    # dspark_sps_startup
    "sglang.srt.speculative.dspark_components.dspark_planner.DSparkVerifyPlanner.__init__": (
        "(self, *, draft_model, gamma, model_runner, device, tp_rank, verify_num_draft_tokens, "
        "tp_sync)"
    ),
    "sglang.srt.speculative.dspark_components.dspark_planner.build_sps_cost_table": (
        "(*, verify_num_draft_tokens)"
    ),
    "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs": (
        "(self, capture_decode_cuda_graph=True)"
    ),
    # dspark_sts_recorder
    "sglang.srt.speculative.dspark_components.dspark_observability.DsparkStepObservers"
    ".observe_verify_step": (
        "(self, *, forward_ct, reqs, bs, proposal_folded, verify_ids_2d, target_logits, layout, "
        "confidence, confidence_raw, prefix_lens, draft_tokens, draft_block, sampling_info, "
        "correct_len, cap_trim_lens, bonus, commit_lens, verify_token_budget, req_pool_indices, "
        "verify_tier_num_tokens, dp_tier_num_tokens)"
    ),
    "sglang.srt.speculative.dspark_components.dspark_observability.DsparkStepObservers"
    ".note_request_finished": "(self, *, rid, natural_stop)",
    # v4_cpu_plain_rope
    "sglang.srt.layers.rotary_embedding.factory.get_rope_cpu": (
        "(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None, "
        "dtype=None, partial_rotary_factor=1.0, device=None)"
    ),
    # v4_cpu_fp8_kv_pool
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure": (
        "(self, *, pre_model_load_memory)"
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config": (
        "(self, pre_model_load_memory)"
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._derive_pool_sizes": (
        "(self, *, config)"
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools": (
        "(self, *, sizes, req_to_token_pool, token_to_kv_pool_allocator)"
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigResult": None,
    "sglang.srt.mem_cache.kv_cache_configurator.is_swa_req_ring": None,
    "sglang.srt.mem_cache.kv_cache_configurator.get_available_gpu_memory": None,
    "sglang.srt.configs.model_config.is_deepseek_v4": None,
    # v4_foreign_tokenizer_chat
    "sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec": (
        "(*, hf_config, tokenizer, tool_call_parser=None)"
    ),
    # v4_cpu_compression_metadata
    "sglang.kernels.ops.attention.dsv4.metadata_kernel._init_compressed_attn_metadata_triton": (
        "(seq_lens, positions, raw_out_loc, page_table=None, page_size=0, "
        "compute_page_indices=True)"
    ),
    # v4_cpu_pinned_lists
    "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend._move_to_device": (
        "(self, x)"
    ),
    # v4_cpu_sparse_attention
    "sglang.srt.layers.attention.deepseek_v4_backend._create_flashmla_metadata": "()",
    "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend.__init__": (
        "(self, model_runner, skip_prefill=False, speculative_step_id=0, topk=0, "
        "speculative_num_steps=0)"
    ),
    "sglang.kernels.ops.attention.flash_mla_sm120._gather_and_dequant": (
        "(k_cache, indices, page_size)"
    ),
    "sglang.kernels.ops.attention.flash_mla_sm120._D": None,
    # v4_cpu_compressor
    "sglang.srt.layers.attention.dsv4.compressor_v2.create_paged_compressor_data": (
        "(compress_ratio, *, is_prefill, token_to_kv_pool, req_to_token, req_pool_indices, "
        "seq_lens, extend_lens=None, seq_lens_cpu=None, extend_lens_cpu=None, "
        "use_prefill_cuda_graph=False, num_q_tokens=None, online_state_slot_offset=0)"
    ),
    "sglang.srt.layers.attention.dsv4.compressor_v2._use_online_compress": "(compress_ratio)",
    "sglang.kernels.ops.attention.dsv4.compress.CompressorPrefillPlan": None,
    "sglang.kernels.ops.attention.dsv4.compress.compress_forward": (
        "(kv_score_buffer, kv_score_input, ape, plan, *, head_dim, compress_ratio, out=None, "
        "is_online=False)"
    ),
    "sglang.kernels.ops.attention.dsv4.compress.compress_norm_rope_store": (
        "(kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size, "
        "use_fp4=False, bf16_store=False, kvcache_scale=None, rope_cache=None, "
        "fp4_k_write_metadata=None, layout=<KVLayout.V4: 'v4'>, fp8_2buff=False, "
        "kvcache_rope=None)"
    ),
    # v4_cpu_mhc
    "sglang.kernels.ops.layernorm.mhc.hc_split_sinkhorn": (
        "(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-06)"
    ),
    "sglang.kernels.ops.layernorm.mhc.mhc_combine": "(x_flat, pre, hc, out_dtype)",
    "sglang.kernels.ops.layernorm.mhc_head.fused_hc_head": (
        "(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps)"
    ),
    "sglang.srt.models.deepseek_v4.hc_head_torch": (
        "(x, hc_fn, hc_scale, hc_base, *, norm_eps, hc_eps)"
    ),
    # v4_cpu_norm_rope
    "sglang.kernels.ops.attention.dsv4.norm_rope.fused_q_norm_rope": (
        "(q_input, q_output, eps, freqs_cis, positions)"
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope.fused_rope_inplace": (
        "(q, k, freqs_cis, positions, inverse=False)"
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope.fused_k_norm_rope_flashmla": (
        "(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, "
        "layout=<KVLayout.V4: 'v4'>, q=None)"
    ),
    "sglang.kernels.ops.attention.dsv4.norm_rope.fused_q_indexer_rope_hadamard_quant": (
        "(q_input, weight, weight_scale, freqs_cis, positions)"
    ),
    # v4_cpu_index_topk
    "sglang.srt.layers.attention.dsv4.indexer.topk_transform_pytorch_vectorized": (
        "(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices=None)"
    ),
    "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer": None,
    # v4_cpu_index_live_pages
    "sglang.srt.layers.attention.dsv4.indexer.fp8_paged_mqa_logits_torch": (
        "(q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata, max_seq_len, "
        "clean_logits=True)"
    ),
    # v4_cpu_swiglu_clamp
    "sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp": (
        "(input, output, swiglu_limit)"
    ),
    "sglang.srt.layers.moe.fused_moe_native.moe_forward_native": (
        "(layer, x, topk_output, moe_runner_config)"
    ),
    # v4_cpu_defaults
    "sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults": (
        "(server_args, model_arch)"
    ),
    "sglang.srt.arg_groups.overrides.declare_resolution": "(server_args, source, **fields)",
    # v4_validation (and apply_deepseek_v4_defaults above)
    "sglang.srt.arg_groups.pipeline.run_resolution_pipeline": "(server_args)",
    # cpu_paged_last_loc
    "sglang.kernels.ops.memory.common.get_last_loc_triton": (
        "(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)"
    ),
    "sglang.srt.mem_cache.allocation.get_last_loc_torch": (
        "(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)"
    ),
}

# Targets a hook changes or calls without the HookRegistry (direct assignment, module
# internals it reads): checked like registered targets, before its install() runs.
DIRECT_TARGETS: dict[str, tuple[str, ...]] = {
    "cpu_engine_for_device_cpu": (
        "sglang.srt.utils.common.is_cpu",
        "sglang.srt.arg_groups.overrides.resolving_view",
    ),
    "cpu_onednn_caches": ("sglang.srt.arg_groups.overrides.resolving_view",),
    "dspark_cpu_device_gate": ("sglang.srt.arg_groups.speculative_hook.resolving_view",),
    "torch_native_draft_backend": (
        "sglang.srt.arg_groups.choices.DRAFT_ATTENTION_BACKEND_CHOICES",
        "sglang.srt.arg_groups.choices.add_draft_attention_backend_choices",
    ),
    "cpu_record_stream_noop": ("torch.Tensor.record_stream",),
    "cpu_eagle_sampling_verify": (
        "sglang.srt.speculative.eagle_utils.tree_speculative_sampling_target_only",
        "sglang.srt.speculative.eagle_utils.top_k_renorm_prob",
        "sglang.srt.speculative.eagle_utils.top_p_renorm_prob",
    ),
    "v4_cpu_fp8_kv_pool": (
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._derive_pool_sizes",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigResult",
        "sglang.srt.mem_cache.kv_cache_configurator.is_swa_req_ring",
        "sglang.srt.mem_cache.kv_cache_configurator.get_available_gpu_memory",
        "sglang.srt.configs.model_config.is_deepseek_v4",
    ),
    "v4_cpu_sparse_attention": (
        "sglang.kernels.ops.attention.flash_mla_sm120._gather_and_dequant",
        "sglang.kernels.ops.attention.flash_mla_sm120._D",
    ),
    "v4_cpu_compressor": (
        "sglang.srt.layers.attention.dsv4.compressor_v2._use_online_compress",
        "sglang.kernels.ops.attention.dsv4.compress.CompressorPrefillPlan",
    ),
    "v4_cpu_mhc": ("sglang.srt.models.deepseek_v4.hc_head_torch",),
    "v4_cpu_index_topk": (
        "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer",
    ),
    "v4_cpu_index_live_pages": (
        "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer",
    ),
    "cpu_paged_last_loc": ("sglang.srt.mem_cache.allocation.get_last_loc_torch",),
    "v4_cpu_defaults": (
        "sglang.srt.arg_groups.overrides.resolving_view",
        "sglang.srt.arg_groups.overrides.declare_resolution",
    ),
    "v4_validation": ("sglang.srt.arg_groups.overrides.resolving_view",),
}


# Hooks that change SGLang without the HookRegistry: how to see that the change is in place.
# Filled by the hook modules themselves (`applied_check`): this module imports no hook.
APPLIED_CHECKS: dict[str, Callable[[], str | None]] = {}


def applied_check(hook: str) -> Callable:
    """Decorator: `fn() -> None | problem` tells whether `hook`'s change is in place."""

    def register(fn: Callable[[], str | None]) -> Callable[[], str | None]:
        APPLIED_CHECKS[hook] = fn
        return fn

    return register


# The targets registered by the hook whose install() is running (None outside install_checked).
_recording: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "sglang_dspark_recording", default=None
)


def _register(target: str, hook: Callable, hook_type_name: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType[hook_type_name])
    recorded = _recording.get()
    if recorded is not None and target not in recorded:
        recorded.append(target)


def register_replace(target: str, impl: Callable) -> None:
    _register(target, impl, "REPLACE")


def register_around(target: str, hook: Callable) -> None:
    _register(target, hook, "AROUND")


def register_before(target: str, hook: Callable) -> None:
    _register(target, hook, "BEFORE")


def register_after(target: str, hook: Callable) -> None:
    _register(target, hook, "AFTER")


# ------------------------------------------------------------------------------- checks
def code_names(code) -> set[str]:
    """Global and attribute names read by `code` and the functions defined inside it (for an
    applied check that a caller still reads the name a hook replaced)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def reads_name(caller: str, target: str) -> bool:
    """Whether the function at dotted path `caller` (unwrapped) still reads the last name of
    `target`: the applied check of a hook that replaces a module attribute its caller looks up
    at call time."""
    fn = inspect.unwrap(resolve(caller))
    return target.rpartition(".")[2] in code_names(fn.__code__)


def resolve(target: str) -> object:
    """The object `HookRegistry` would wrap for `target` (a classmethod's function, not the
    bound method). Raises ImportError / AttributeError / ValueError when it does not exist."""
    parent, _, attr = target.rpartition(".")
    if not parent:
        raise ValueError(f"{target!r} is not a dotted module.attribute path")
    owner = pkgutil.resolve_name(parent)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (classmethod, staticmethod)):
        return raw.__func__
    return getattr(owner, attr)


def signature_text(fn: object) -> str | None:
    """`inspect.signature` without annotations, e.g. "(self, pool)"; None when it has none."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    empty = inspect.Parameter.empty
    params = [p.replace(annotation=empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def check_target(target: str) -> tuple[object | None, str | None]:
    """(the live object, None) when `target` exists with the recorded signature, else
    (None or the object, a sentence saying what differs)."""
    try:
        live = resolve(target)
    except Exception as exc:  # noqa: BLE001 - any failure to resolve is the finding
        return None, (
            f"{target} does not resolve ({type(exc).__name__}: {exc}): renamed or removed upstream?"
        )
    if target not in UPSTREAM_SIGNATURES:
        return live, (
            f"{target} has no recorded upstream signature; add "
            f"{target!r}: {signature_text(live)!r} to UPSTREAM_SIGNATURES in "
            "sglang_dspark/plugin/registry.py after checking the hook against it"
        )
    want = UPSTREAM_SIGNATURES[target]
    if want is not None:
        have = signature_text(live)
        if have != want:
            return live, f"{target} has the signature {have}, the hook was written against {want}"
    return live, None


@dataclass
class HookCheck:
    """What `install_checked` found for one hook."""

    name: str
    targets: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def install_checked(hooks: dict[str, Callable[[], None]]) -> list[HookCheck]:
    """Install every hook, check its targets, apply all hooks, verify each is in place.

    Every hook is installed and checked on its own, so the result lists every failing hook.
    Hooks are applied only when none failed before application.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    checks: list[HookCheck] = []
    originals: dict[str, object] = {}
    for name, install in hooks.items():
        check = HookCheck(name)
        checks.append(check)
        for target in DIRECT_TARGETS.get(name, ()):
            _, problem = check_target(target)
            if problem:
                check.problems.append(problem)
        if check.problems:
            continue  # do not run an install whose upstream names are already known wrong
        token = _recording.set([])
        try:
            install()
        except Exception as exc:  # noqa: BLE001 - collected, reported with every other failure
            check.problems.append(f"install() raised {type(exc).__name__}: {exc}")
        finally:
            check.targets = _recording.get() or []
            _recording.reset(token)
        for target in check.targets:
            live, problem = check_target(target)
            if problem:
                check.problems.append(problem)
            elif target not in originals:
                originals[target] = live
    if any(c.problems for c in checks):
        return checks

    HookRegistry.apply_hooks()  # idempotent: SGLang's own call after the plugins skips these
    for check in checks:
        for target in check.targets:
            try:
                now = resolve(target)
            except Exception as exc:  # noqa: BLE001
                check.problems.append(f"{target} vanished while hooks were applied: {exc}")
                continue
            if now is originals[target]:
                check.problems.append(
                    f"{target} is not patched: SGLang's HookRegistry did not apply the hook "
                    "(its log says why: 'Failed to apply hooks to ...')"
                )
        verify = APPLIED_CHECKS.get(check.name)
        try:
            problem = verify() if verify is not None else None
        except Exception as exc:  # noqa: BLE001
            problem = f"its check raised {type(exc).__name__}: {exc}"
        if problem:
            check.problems.append(f"not applied: {problem}")
    return checks

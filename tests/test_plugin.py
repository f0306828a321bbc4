"""Every plugin hook: the failure on an unmodified SGLang, and the fix with the plugin.

`tests/probes/hooks.py` runs one probe per hook on the exact SGLang code path the hook
changes. It runs twice: with `SGLANG_PLUGINS=none` (SGLang loads no plugin: upstream
behaviour, plus patch 0001 so that the modules import at all) and with our plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dspark.plugin import _hooks

PROBE = Path(__file__).parent / "probes" / "hooks.py"
# Each probe run imports SGLang in a child process, twice (about a minute): not the fast lane.
pytestmark = pytest.mark.slow

# What each hook's probe shows on an unmodified SGLang.
UPSTREAM_FAILURE = {
    "cpu_engine_for_device_cpu": "resolved without SGLANG_USE_CPU_ENGINE=1",
    "cpu_onednn_caches": "resolved with {'LRU_CACHE_CAPACITY': None, 'ONEDNN_PRIMITIVE",
    "cpu_scheduler_malloc_trim": "no heap trimmer before the CPU scheduler's event loop",
    "cpu_sgl_kernel_ops": "sgl_kernel op assign_req_to_token_pool_cpu is unavailable",
    "dspark_cpu_device_gate": "only supports CUDA, NPU or XPU",
    "torch_native_draft_backend": "torch_native is not an allowed DSPARK draft backend",
    "dspark_draft_validation": "only supports CUDA, NPU or XPU",  # never reaches a check
    "cpu_record_stream_noop": "unknown parameter type",
    "torch_native_target_verify": "'NoneType' object has no attribute 'shape'",
    "cpu_bf16_draft_kernels": "table_qk_norm_rope_ (Triton)",
    "cpu_half_gemm_fp32": "a 16-row bf16 linear ran torch's bf16 GEMM",
    "cpu_rejection_sampler": "0 active drivers",
    "cpu_greedy_markov_step": "Philox noise drawn for an all-greedy step",
    "cpu_sampled_markov_step": "Philox noise drawn in torch for a sampled CPU step",
    "cpu_verified_rows_accept": "rows past the verify window were read",
    "cpu_draft_until_verifiable": "the Markov head stepped 14 rows, 2 are verified",
    "cpu_plain_rounds": "the draft forward ran for a round the policy made plain",
    "dspark_scheduler_mode": "only supports CUDA, NPU or XPU",  # never reaches a check
    "dspark_sync_scheduler": "budget 8, Algorithm 1 on the current confidences: 1",
    "dspark_sps_startup": "is not the profiled one (flat: scheduling off)",
    "dspark_sts_recorder": "shape '[2, 5]' is invalid",
    "dspark_verify_trace": "no verify trace written",
    "eagle_cpu_chain_only": "a top-4 tree was accepted on CPU",
    "eagle_torch_native_draft_extend": "EAGLE is not supported in attention backend torch_native",
    "cpu_eagle_tree_ops": "build_tree_kernel_efficient_cpu is unavailable",
    "cpu_eagle_sampling_verify": "verified greedily (target argmax)",
    "cpu_row_argmax": "0 active drivers",
    "v4_cpu_defaults": "DeepSeek-V4 --device cpu resolved with {'SGLANG_FP8_PAGED_MQA_LOGITS_TORCH'",
    "v4_foreign_tokenizer_chat": "is not in the added vocabulary",
    "v4_cpu_plain_rope": "get_rope_cpu asserts on rope_scaling=None",
    "v4_cpu_fp8_kv_pool": "CPU FP8 KV cache requires",
    "v4_cpu_compression_metadata": "0 active drivers",
    "v4_cpu_sparse_attention": "Could not load this library",
    "v4_cpu_compressor": "Found no NVIDIA driver",
    "v4_cpu_norm_rope": "Failed to build JIT module",
    "v4_cpu_index_topk": "ran SGLang's torch top-k, no dspark_kernels call",
    "v4_cpu_index_live_pages": "gathered page-table columns past every row's length",
    "v4_cpu_mhc": "hc_split_sinkhorn's TileLang kernel failed on CPU",
    "v4_cpu_swiglu_clamp": "moe_forward_native ignored swiglu_limit",
    "cpu_paged_last_loc": "0 active drivers",
    "v4_cpu_pinned_lists": "Found no NVIDIA driver",
    "v4_validation": "compress_ratios [0, 8, 128, 4]: KeyError: 8,",
}


@pytest.fixture(scope="module")
def bad_draft(embedded_paths, tmp_path_factory):
    cfg = json.loads((embedded_paths.draft / "config.json").read_text())
    cfg["target_layer_ids"] = cfg["target_layer_ids"][:-1] + [29]  # the target's last layer
    out = tmp_path_factory.mktemp("bad-draft")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def tiny_v4_path() -> Path:
    """The tiny DeepSeek-V4 checkpoint (built into the cache once, a few seconds)."""
    from sglang_dspark.v4 import tiny

    return tiny.build_tiny_v4()


def _run_probes(embedded_paths, bad_draft, plugins: bool) -> dict[str, dict]:
    env = dict(os.environ)
    env.update(
        PROBE_TARGET=str(embedded_paths.target),
        PROBE_DRAFT=str(embedded_paths.draft),
        PROBE_BAD_DRAFT=str(bad_draft),
        PROBE_MTP_DRAFT=str(embedded_paths.mtp1_draft),
        PROBE_V4=str(tiny_v4_path()),
        SGLANG_USE_CPU_ENGINE="1",
    )
    if not plugins:
        env["SGLANG_PLUGINS"] = "none"
    proc = subprocess.run(
        [sys.executable, str(PROBE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            r = json.loads(line[6:])
            results[r["probe"]] = r
    assert results, f"probe script failed:\n{proc.stderr[-3000:]}"
    return results


@pytest.fixture(scope="module")
def upstream(embedded_paths, bad_draft):
    return _run_probes(embedded_paths, bad_draft, plugins=False)


@pytest.fixture(scope="module")
def plugged(embedded_paths, bad_draft):
    return _run_probes(embedded_paths, bad_draft, plugins=True)


def test_every_hook_has_a_probe():
    assert set(_hooks()) == set(UPSTREAM_FAILURE)


@pytest.mark.parametrize("hook", sorted(UPSTREAM_FAILURE))
def test_hook_fixes_upstream_failure(hook, upstream, plugged):
    assert not upstream[hook]["ok"], f"{hook}: unmodified SGLang did not fail"
    assert UPSTREAM_FAILURE[hook] in upstream[hook]["error"]
    assert plugged[hook]["ok"], f"{hook} with the plugin: {plugged[hook]['error']}"


def test_unpatched_sgl_kernel_import_fails():
    """Why patch 0001 exists: SGLang's CPU modules import these at module level."""
    proc = subprocess.run(
        [sys.executable, "-c", "from sgl_kernel import copy_all_layer_kv_cache_cpu"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "ImportError" in proc.stderr


def test_disable_hooks_env_turns_one_hook_off(embedded_paths, bad_draft):
    env = dict(os.environ, SGLANG_DSPARK_DISABLE_HOOKS="cpu_record_stream_noop")
    proc = subprocess.run(
        [sys.executable, str(PROBE), "cpu_record_stream_noop"], env=env, capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    assert json.loads(line[6:])["ok"] is False

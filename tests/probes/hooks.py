"""Run each plugin hook's probe in this process and print one JSON line per probe.

    SGLANG_PLUGINS=none python tests/probes/hooks.py        # unmodified SGLang (+ patch 0001)
    python tests/probes/hooks.py                            # with the sglang-dspark plugin

Each probe exercises exactly the SGLang code path its hook changes, on CPU tensors, and
reports {"probe": name, "ok": bool, "error": "..."}; tests/test_plugin.py runs both ways.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch
from sglang.srt.plugins import load_plugins

load_plugins()

PROBES = {}


def probe(fn):
    PROBES[fn.__name__] = fn
    return fn


@probe
def cpu_sgl_kernel_ops():
    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_func
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.kernels.ops.speculative.eagle import (
        fill_accept_out_cache_loc_func,
        fill_bonus_tokens_func,
    )
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool_func

    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    rpi = torch.tensor([2, 0])
    start, end = torch.tensor([3, 0]), torch.tensor([6, 2])
    locs = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64)
    assign_req_to_token_pool_func(rpi, req_to_token, start, end, locs, 2)
    assert req_to_token[2, 3:6].tolist() == [10, 11, 12] and req_to_token[0, :2].tolist() == [
        20,
        21,
    ]
    out = assign_extend_cache_locs_func(
        req_pool_indices=rpi, req_to_token=req_to_token, start_offset=start, end_offset=end,
        batch_size=2, draft_token_num=3, device="cpu",
    )  # fmt: skip
    assert out[:5].tolist() == [10, 11, 12, 20, 21]

    accept_tokens = torch.tensor([[5, 6, 7], [8, 9, 1]])
    bonus = torch.zeros(2, dtype=torch.int64)
    fill_bonus_tokens_func(accept_tokens, torch.tensor([2, 3]), bonus, 3, 2)
    assert bonus.tolist() == [6, 1]
    acc_out = torch.full((4,), -1, dtype=torch.int64)
    fill_accept_out_cache_loc_func(
        torch.tensor([0, -1, 2, 3]), torch.tensor([40, 41, 42, 43]), acc_out, 4
    )
    assert acc_out[:3].tolist() == [40, 42, 43]

    layers = [torch.arange(32, dtype=torch.float32).view(8, 4).clone() for _ in range(2)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    copy_all_layer_kv_cache_func(
        ptrs, strides, torch.tensor([6, 7]), torch.tensor([1, 2]), 2, 2, {}
    )
    for t in layers:
        assert t[6].tolist() == [4, 5, 6, 7] and t[7].tolist() == [8, 9, 10, 11]


@probe
def cpu_engine_for_device_cpu():
    from sglang.srt.server_args import prepare_server_args

    saved = os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    try:
        args = prepare_server_args([
            "--model-path", os.environ["PROBE_TARGET"], "--device", "cpu",
            "--attention-backend", "torch_native",
        ])  # fmt: skip
        args.resolve_once()
        engine = os.environ.get("SGLANG_USE_CPU_ENGINE")
    finally:
        if saved is None:
            os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
        else:
            os.environ["SGLANG_USE_CPU_ENGINE"] = saved
    assert engine == "1", (
        "--device cpu resolved without SGLANG_USE_CPU_ENGINE=1: the scheduler would take the "
        "GPU code path (No module named 'vllm')"
    )


@probe
def cpu_onednn_caches():
    from sglang.srt.server_args import prepare_server_args

    names = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        args = prepare_server_args([
            "--model-path", os.environ["PROBE_TARGET"], "--device", "cpu",
            "--attention-backend", "torch_native",
        ])  # fmt: skip
        args.resolve_once()
        capacity = {n: os.environ.get(n) for n in names}
    finally:
        for n in names:
            os.environ.pop(n, None)
        os.environ.update(saved)
    assert capacity == dict.fromkeys(names, "16"), (
        f"--device cpu resolved with {capacity}: ideep and oneDNN keep up to 1024 entries "
        "each, one per verify batch shape"
    )


@probe
def cpu_scheduler_malloc_trim():
    import threading

    from sglang.srt.managers.scheduler import Scheduler

    # a stand-in scheduler: the body fails at once, after any `before` hook has run
    with contextlib.suppress(Exception):
        Scheduler.run_event_loop(SimpleNamespace(device="cpu"))
    names = {t.name for t in threading.enumerate()}
    assert "sglang-dspark-malloc-trim" in names, (
        "no heap trimmer before the CPU scheduler's event loop: freed per-step tensors stay in "
        "glibc's heap and the scheduler's RSS grows with every request"
    )


@probe
def dspark_cpu_device_gate():
    _resolve(os.environ["PROBE_DRAFT"])


@probe
def torch_native_draft_backend():
    from sglang.srt.speculative import draft_worker_common

    assert "torch_native" in draft_worker_common.DRAFT_ATTENTION_BACKEND_CHOICES, (
        "torch_native is not an allowed DSPARK draft backend; the draft worker falls back to "
        "flashinfer"
    )


@probe
def dspark_draft_validation():
    # a draft whose last target layer cannot be captured must be refused at resolution
    try:
        _resolve(os.environ["PROBE_BAD_DRAFT"])
    except ValueError as exc:
        if "target_layer_id" in str(exc):
            return
        raise
    raise AssertionError("a draft with an uncapturable target layer was accepted")


@probe
def cpu_record_stream_noop():
    torch.zeros(2).record_stream(torch.cpu.current_stream())


@probe
def torch_native_target_verify():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    torch.manual_seed(0)
    heads, kv_heads, dim, ctx, win = 4, 2, 8, 5, 3
    k_cache = torch.randn(32, kv_heads, dim)
    v_cache = torch.randn(32, kv_heads, dim)
    pool = SimpleNamespace(
        set_kv_buffer=lambda layer, loc, k, v: (
            k_cache.index_copy_(0, loc.loc, k.view(-1, kv_heads, dim)),
            v_cache.index_copy_(0, loc.loc, v.view(-1, kv_heads, dim)),
        ),
        get_key_buffer=lambda i: k_cache,
        get_value_buffer=lambda i: v_cache,
    )
    req_to_token = torch.zeros(2, 16, dtype=torch.int64)
    req_to_token[0, :ctx] = torch.arange(ctx)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    backend.token_to_kv_pool = pool
    backend.swa_out_cache_loc = None
    out_loc = torch.arange(ctx, ctx + win)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=1, req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([ctx]), out_cache_loc=out_loc, extend_prefix_lens=None,
        extend_seq_lens=None, encoder_lens=None, extend_seq_lens_cpu=None,
    )  # fmt: skip
    q, k, v = (
        torch.randn(win, heads * dim),
        torch.randn(win, kv_heads * dim),
        torch.randn(win, kv_heads * dim),
    )
    for attn_type, causal in [(AttentionType.DECODER, True), (AttentionType.ENCODER_ONLY, False)]:
        layer = SimpleNamespace(
            tp_q_head_num=heads, tp_k_head_num=kv_heads, tp_v_head_num=kv_heads, qk_head_dim=dim,
            v_head_dim=dim, layer_id=0, is_cross_attention=False, attn_type=attn_type,
            scaling=dim**-0.5, sliding_window_size=None, logit_cap=0, k_scale=None, v_scale=None,
        )  # fmt: skip
        # save_kv_cache=False first, while the pool's window slots still hold other keys: the
        # window's keys must come from this pass
        unsaved = backend.forward_extend(q, k, v, layer, batch, save_kv_cache=False)
        out = backend.forward_extend(q, k, v, layer, batch).view(win, heads, dim)
        # reference: context + window keys, grouped-query heads, causal or full inside the window
        keys = torch.cat([k_cache[:ctx], k.view(win, kv_heads, dim)]).repeat_interleave(2, 1)
        vals = torch.cat([v_cache[:ctx], v.view(win, kv_heads, dim)]).repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", q.view(win, heads, dim), keys) * dim**-0.5
        if causal:
            mask = torch.ones(win, ctx + win, dtype=torch.bool)
            mask[:, ctx:] = torch.ones(win, win, dtype=torch.bool).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(unsaved.view(win, heads, dim), ref, rtol=1e-4, atol=1e-5)

    # `compact` verify: windows of 1 and 2 tokens for two requests (SGLang's ragged layout);
    # each request's rows must equal a verify pass of that request alone.
    req_to_token[1, :3] = torch.tensor([20, 21, 22])
    lens = [1, 2]
    ragged = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2, req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([ctx, 3]), out_cache_loc=torch.tensor([24, 25, 26]),
        extend_prefix_lens=None, extend_seq_lens=None, encoder_lens=None, extend_seq_lens_cpu=None,
        spec_info=SimpleNamespace(ragged_verify_layout=SimpleNamespace(
            verify_lens_cpu=lens, verify_lens=torch.tensor(lens))),
    )  # fmt: skip
    # The whole batch is one padded SDPA call: different context and window lengths, for causal
    # (target) and bidirectional (draft) layers.
    q3, k3, v3 = q[:3], k[:3], v[:3]
    for attn_type in [AttentionType.DECODER, AttentionType.ENCODER_ONLY]:
        layer.attn_type = attn_type
        out = backend.forward_extend(q3, k3, v3, layer, ragged)
        for i, (lo, hi) in enumerate([(0, 1), (1, 3)]):
            single = SimpleNamespace(
                forward_mode=ForwardMode.TARGET_VERIFY, batch_size=1,
                req_pool_indices=torch.tensor([i]), seq_lens=ragged.seq_lens[i : i + 1],
                out_cache_loc=ragged.out_cache_loc[lo:hi], extend_prefix_lens=None,
                extend_seq_lens=None, encoder_lens=None, extend_seq_lens_cpu=None,
            )  # fmt: skip
            ref = backend.forward_extend(q3[lo:hi], k3[lo:hi], v3[lo:hi], layer, single)
            torch.testing.assert_close(out[lo:hi], ref, rtol=1e-5, atol=1e-6)


@probe
def cpu_bf16_draft_kernels():
    from sglang.srt.models import dspark
    from sglang.srt.runtime_context import get_context
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(os.environ["PROBE_DRAFT"])
    with get_context().override_server_args(device="cpu"):
        model = dspark.Qwen3DSparkModel(cfg).to(torch.bfloat16)
    triton_rope = [layer.self_attn.use_table_qk_norm_rope for layer in model.layers]
    assert not any(triton_rope), "bf16 q/k norm + rope would run table_qk_norm_rope_ (Triton)"
    assert model._fused_kv_write_bundle(None) is None, (
        "bf16 context KV write would run fused_kv_norm_rope_write (Triton)"
    )


@probe
def cpu_rejection_sampler():
    from sglang.kernels.ops.speculative.dspark import dspark_accept

    bs, n, vocab = 2, 4, 6
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    target = torch.softmax(torch.randn(bs, n, vocab), -1)
    dspark_accept.chain_speculative_sampling_triton(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
        candidates=torch.randint(0, vocab, (bs, n)), retrive_index=torch.arange(bs * n).view(bs, n),
        retrive_next_token=None, retrive_next_sibling=None,
        uniform_samples=torch.rand(bs, n - 1), uniform_samples_for_final_sampling=torch.rand(bs),
        target_probs=target, draft_probs=torch.softmax(torch.randn(bs, n - 1, vocab), -1),
        threshold_single=1.0, threshold_acc=1.0, deterministic=True,
    )  # fmt: skip
    assert (accept_num >= 0).all() and (accept_index[:, 0] == torch.tensor([0, n])).all()


def _markov_step(temperatures: list[float], noise_refusal: str | None):
    """SGLang's CPU Markov sampling step on seeded [3, 40] logits; with `noise_refusal`, its
    torch Philox raises that message if called. Returns (tokens, base + bias, kept logits)."""
    from sglang.kernels.ops.speculative.dspark import markov_sample

    def no_noise(*args, **kwargs):
        raise AssertionError(noise_refusal)

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 40, generator=gen)
    bias = torch.randn(3, 40, generator=gen)
    kept = torch.empty(3, 40)
    original = markov_sample._philox
    if noise_refusal:
        markov_sample._philox = no_noise
    try:
        tokens = markov_sample.MarkovSampleStep.torch(
            base_logits=base, bias=bias, temperatures=torch.tensor(temperatures), key=7,
            offset=torch.zeros(1, dtype=torch.int64), step=0, step_dtype=torch.float32,
            logits_out=kept, has_sampled_rows=None,
        )  # fmt: skip
    finally:
        markov_sample._philox = original
    return tokens, base + bias, kept


@probe
def cpu_greedy_markov_step():
    sampled, _, _ = _markov_step([0.0, 1.0, 0.0], None)  # a sampled row still runs
    assert sampled.shape == (3,)
    tokens, logits, kept = _markov_step([0.0] * 3, "Philox noise drawn for an all-greedy step")
    assert torch.equal(tokens, logits.argmax(-1)), tokens
    assert torch.equal(kept, logits)


@probe
def cpu_sampled_markov_step():
    tokens, logits, kept = _markov_step(
        [0.0, 1.0, 0.0], "Philox noise drawn in torch for a sampled CPU step"
    )
    assert torch.equal(kept, logits)  # the proposal the verifier reads
    greedy = logits.argmax(-1)
    assert tokens[0] == greedy[0] and tokens[2] == greedy[2] and 0 <= tokens[1] < 40, tokens


@probe
def dspark_scheduler_mode():
    os.environ["SGLANG_DSPARK_SCHEDULER"] = "sync"
    os.environ.pop("SGLANG_RAGGED_VERIFY_MODE", None)
    try:
        args = _resolve(os.environ["PROBE_DRAFT"])
        mode = os.environ.get("SGLANG_RAGGED_VERIFY_MODE")
    finally:
        os.environ.pop("SGLANG_DSPARK_SCHEDULER", None)
        os.environ.pop("SGLANG_RAGGED_VERIFY_MODE", None)
    assert mode == "compact", f"SGLANG_RAGGED_VERIFY_MODE={mode!r}: the sync mode was not set"
    declared = [f for _, f in getattr(args, "_resolved_overrides", [])]
    assert {"disable_overlap_schedule": True} in declared, "overlap scheduling was left on"


def _sps_table(xs, ys):
    from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable

    return SpsCostTable(sample_batch_tokens=xs, sample_steps_per_sec=ys, max_batch_tokens=xs[-1])


@probe
def dspark_sync_scheduler():
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk
    from sglang.srt.speculative.dspark_components.dspark_planner import (
        DSparkScheduleConfig,
        HostConfidenceBudgetPlanner,
    )

    from sglang_dspark.scheduling.scheduler import schedule_sync

    # 1. The budget. SPS falls off a cliff at 4 tokens, then recovers: the unconstrained
    # argmax jumps the cliff, Algorithm 1 stops before it. Current confidences, no lag.
    table = _sps_table([1, 2, 3, 4, 6], [10.0, 10.0, 9.5, 4.0, 4.0])
    c = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.2, 0.9, 0.9, 0.9]])
    cfg = DSparkScheduleConfig(gamma=4)
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 8)))

    def budget_of(c, table):
        planner = HostConfidenceBudgetPlanner(
            sps_table=table, cfg=cfg, model_runner=runner, relay_lag_steps=0
        )
        return planner.compute_budget(
            confidence=c, generation=torch.ones(len(c), dtype=torch.int64),
            current_generation=torch.ones(len(c), dtype=torch.int64),
            req_pool_indices_cpu=torch.arange(len(c)),
        )  # fmt: skip

    os.environ["SGLANG_DSPARK_SCHEDULER"] = "sync"
    try:
        budget = budget_of(c, table)
        want = int(schedule_sync(c, table).sum())
        assert budget == want, f"budget {budget}, Algorithm 1 on the current confidences: {want}"
        # 2. The lengths. Flat SPS: Algorithm 1 verifies every draft that can survive at all,
        # including request 0's drafts 3-4 (survival 8e-8, below SGLang's survival_eps 1e-6).
        c = torch.tensor([[0.9, 0.9, 1e-7, 0.5], [0.9, 0.9, 0.9, 0.9]])
        flat = _sps_table([1, 16], [10.0, 10.0])
        budget = budget_of(c, flat)
        lens = ScheduleVerifyLensTopk.execute(confidence=c, budget=budget, cfg=cfg)
    finally:
        os.environ.pop("SGLANG_DSPARK_SCHEDULER", None)
    want = (1 + schedule_sync(c, flat)).tolist()
    assert lens.tolist() == want, (
        f"verify_lens {lens.tolist()} from SGLang's top-K, Algorithm 1's: {want}"
    )


@probe
def cpu_verified_rows_accept():
    """A sampled accept with drafts past each verify window that are not tokens at all (id 45
    of 40) and NaN logits there: only the rows inside the windows may be read."""
    from sglang.kernels.ops.speculative.dspark import dspark_accept
    from sglang.srt.speculative.dspark_components import dspark_verify
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult

    from sglang_dspark.verification import rejection

    bs, gamma, vocab = 2, 3, 40
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([2, 4])  # request 0 verifies 1 draft, request 1 all 3
    target = torch.randn(bs, gamma + 1, vocab, generator=gen)
    draft = torch.randn(bs, gamma, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (bs, gamma), generator=gen)
    drafts[0, 1:] = 45
    draft[0, 1:] = float("nan")
    target[0, 2:] = float("nan")
    info = SimpleNamespace(is_all_greedy=False, is_any_greedy=False, need_top_k_sampling=False,
                           need_top_p_sampling=False, temperatures=torch.ones(bs, 1))  # fmt: skip
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=draft,
                             greedy_mask=torch.zeros(bs, dtype=torch.bool),
                             temperatures=torch.ones(bs), greedy_draft=False)  # fmt: skip
    sampler = dspark_accept.chain_speculative_sampling_triton
    if os.environ.get("SGLANG_PLUGINS") == "none":  # upstream: its sampler needs Triton
        dspark_accept.chain_speculative_sampling_triton = rejection.chain_speculative_sampling_torch
    try:
        correct, bonus, _ = dspark_verify.accept_draft_tokens(
            candidates=torch.cat([torch.zeros(bs, 1, dtype=torch.long), drafts], 1),
            target_logits=target.view(-1, vocab), draft_block=block, sampling_info=info,
            draft_input=None, gamma=gamma, verify_num_draft_tokens=gamma + 1,
            cutoff_layout=SimpleNamespace(verify_lens=lens),
        )  # fmt: skip
    except (IndexError, RuntimeError) as exc:
        raise AssertionError(f"rows past the verify window were read ({exc})") from exc
    finally:
        dspark_accept.chain_speculative_sampling_triton = sampler
    assert (correct <= lens - 1).all() and ((bonus >= 0) & (bonus < vocab)).all(), (correct, bonus)


class _ProbeDraft(torch.nn.Module):
    """A DSPARK draft head on random weights whose confidence is 0.3 at every position; counts
    the rows its Markov head steps."""

    def __init__(self, hidden: int, vocab: int) -> None:
        from sglang.srt.models.dspark import DSparkConfidenceHead, VanillaMarkov

        super().__init__()
        self.markov_head = VanillaMarkov(vocab_size=vocab, markov_rank=4)
        self.confidence_head = DSparkConfidenceHead(hidden_size=hidden, markov_rank=4)
        torch.nn.init.zeros_(self.confidence_head.proj.weight)
        torch.nn.init.constant_(self.confidence_head.proj.bias, -0.8473)  # logit(0.3)
        self.lm = torch.nn.Linear(hidden, vocab, bias=False)
        self.sample_from_anchor = True
        self.steps = 0
        step_bias = self.markov_head.step_bias

        def counted(prev_tokens, **kwargs):
            self.steps += len(prev_tokens)
            return step_bias(prev_tokens, **kwargs)

        self.markov_head.step_bias = counted

    def compute_base_logits(self, hidden):
        return self.lm(hidden), hidden

    def compute_confidence(self, *, anchor_tokens, draft_tokens, confidence_features):
        return self.confidence_head.predict(
            confidence_features, anchor_tokens=anchor_tokens, draft_tokens=draft_tokens,
            markov_head=self.markov_head,
        )  # fmt: skip


@probe
def cpu_draft_until_verifiable():
    """A greedy sync step of 2 requests, 7 drafts each, confidence 0.3 everywhere and an SPS
    table where only each request's first draft pays: the Markov head may step only those."""
    from sglang.srt.speculative.dspark_components.dspark_draft import (
        DraftBlockProposer,
        DraftNoise,
    )
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig

    from sglang_dspark.scheduling.scheduler import schedule_sync

    bs, gamma, hidden, vocab = 2, 7, 16, 40
    torch.manual_seed(0)
    model = _ProbeDraft(hidden, vocab)
    raw = torch.randn(bs * gamma, hidden)
    ids = torch.zeros(bs, gamma, dtype=torch.long)
    ids[:, 0] = torch.tensor([3, 5])
    table = _sps_table(list(range(1, 65)), [1.0 / (0.05 + 0.01 * b) for b in range(1, 65)])
    noise = DraftNoise(key=7, offset=torch.zeros(1, dtype=torch.int64))
    proposer = SimpleNamespace(
        draft_model=model, gamma=gamma, sample_from_anchor=True, _draft_sampler=None,
        _greedy_draft=False, _noise=noise, noise=noise,
        _tp_sync=SimpleNamespace(sync=lambda site, x: x),
        _base_logits_context=contextlib.nullcontext,
        _run_forward=lambda **kw: SimpleNamespace(
            draft_block_ids=ids, raw_hidden=raw, draft_hidden_3d=raw.view(bs, gamma, -1),
            can_run_graph=False),
        _dspark_verify_planner=SimpleNamespace(_budget_planner=SimpleNamespace(
            sps_table=table, cfg=DSparkScheduleConfig(gamma=gamma), forced_budget_frac=None)),
    )  # fmt: skip
    target = SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(vocab, hidden))
    os.environ["SGLANG_DSPARK_SCHEDULER"] = "sync"
    try:
        with torch.inference_mode():
            proposal = DraftBlockProposer.propose(
                proposer, batch=None, draft_input=None, verify_window=None, bs=bs,
                device="cpu", target_model=target, sampling_info=None,
            )  # fmt: skip
    finally:
        os.environ.pop("SGLANG_DSPARK_SCHEDULER", None)
    lengths = schedule_sync(proposal.confidence.double(), table)
    verified = int(lengths.max())
    assert verified == 1, lengths
    assert model.steps == bs * verified, (
        f"the Markov head stepped {model.steps} rows, {bs * verified} are verified"
    )


@probe
def cpu_plain_rounds():
    """A sampled sync step of 2 requests that the plain-round policy made plain (what the hook on
    `_forward_decode` sets before the draft pass): no draft forward, no drafts, every
    confidence 0, so the sync scheduler verifies the anchor alone."""
    from sglang.srt.speculative.dspark_components.dspark_draft import (
        DraftBlockProposer,
        DraftNoise,
    )
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig

    from sglang_dspark.scheduling.scheduler import schedule_sync

    bs, gamma, hidden, vocab = 2, 7, 16, 40
    torch.manual_seed(0)
    model = _ProbeDraft(hidden, vocab)
    raw = torch.randn(bs * gamma, hidden)
    ids = torch.zeros(bs, gamma, dtype=torch.long)
    forwards = []

    def run_forward(**kw):
        forwards.append(1)
        ids[:, 0] = kw["draft_input"].bonus_tokens
        return SimpleNamespace(draft_block_ids=ids, raw_hidden=raw,
                               draft_hidden_3d=raw.view(bs, gamma, -1), can_run_graph=False)  # fmt: skip

    table = _sps_table(list(range(1, 65)), [1.0 / (0.05 + 0.01 * b) for b in range(1, 65)])
    noise = DraftNoise(key=7, offset=torch.zeros(1, dtype=torch.int64))
    proposer = SimpleNamespace(
        draft_model=model, gamma=gamma, sample_from_anchor=True, _draft_sampler=None,
        _greedy_draft=False, _noise=noise, noise=noise, deferred_commit=None,
        _tp_sync=SimpleNamespace(sync=lambda site, x: x),
        _base_logits_context=contextlib.nullcontext, _run_forward=run_forward,
        draft_block_ids_view=lambda bs, device: ids,
        _dspark_plain_wanted=True,
        _dspark_verify_planner=SimpleNamespace(is_compact_mode=True, _budget_planner=SimpleNamespace(
            sps_table=table, cfg=DSparkScheduleConfig(gamma=gamma), forced_budget_frac=None)),
    )  # fmt: skip
    target = SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(vocab, hidden))
    info = SimpleNamespace(is_all_greedy=False, is_any_greedy=False, need_top_k_sampling=False,
                           need_top_p_sampling=False, temperatures=torch.ones(bs, 1),
                           top_ks=torch.zeros(bs, dtype=torch.int32),
                           top_ps=torch.ones(bs), min_ps=torch.zeros(bs))  # fmt: skip
    os.environ["SGLANG_DSPARK_SCHEDULER"] = "sync"
    try:
        with torch.inference_mode():
            proposal = DraftBlockProposer.propose(
                proposer, batch=None, draft_input=SimpleNamespace(bonus_tokens=torch.tensor([3, 5])),
                verify_window=None, bs=bs, device="cpu", target_model=target,
                sampling_info=info,
            )  # fmt: skip
    finally:
        os.environ.pop("SGLANG_DSPARK_SCHEDULER", None)
    assert not forwards, "the draft forward ran for a round the policy made plain"
    assert proposal.draft_block_ids[:, 0].tolist() == [3, 5]
    assert int(schedule_sync(proposal.confidence.double(), table).max()) == 0


@probe
def dspark_sps_startup():
    import tempfile

    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative.dspark_components import dspark_planner

    from sglang_dspark.plugin import scheduling
    from sglang_dspark.scheduling import sps

    os.environ["DSPARK_CACHE_DIR"] = tempfile.mkdtemp()
    runner = SimpleNamespace(
        server_args=SimpleNamespace(model_path=os.environ["PROBE_TARGET"], attention_backend="x",
                                    tp_size=1),
        dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    key = scheduling.sps_key_for(runner, verify_num_draft_tokens=8, max_requests=4)
    cached = _sps_table([1, 8, 32], [10.0, 9.0, 5.0])
    sps.save_cached(key, cached, seconds=0.0)
    with get_context().override_server_args(device="cpu", max_running_requests=4):
        hook_ctx = getattr(scheduling, "_planner_ctx", {})
        hook_ctx["runner"] = runner  # what the hook on DSparkVerifyPlanner.__init__ records
        try:
            table = dspark_planner.build_sps_cost_table(verify_num_draft_tokens=8)
        finally:
            hook_ctx.clear()
    assert table == cached, f"SPS table {table} is not the profiled one (flat: scheduling off)"


def _step_observers(sts_stem: str, gamma: int):
    """The fields of DsparkStepObservers that observe_verify_step reads, compact verify on."""
    from sglang.srt.speculative.dspark_components.dspark_observability import (
        DsparkStepObservers,
    )

    observers = SimpleNamespace(
        _sts_collect_path=sts_stem, _sts_recorder=None, _gamma=gamma,
        _verify_num_draft_tokens=gamma + 1, _block_accept_recorder=None,
        _planner=SimpleNamespace(carries_confidence=True, is_compact_mode=True),
        _confidence_probe=SimpleNamespace(maybe_observe=lambda **kw: None),
        _info_dumper=SimpleNamespace(enabled=False),
        _maybe_record_sts_collect=lambda **kw: DsparkStepObservers._maybe_record_sts_collect(
            observers, **kw),
    )  # fmt: skip
    return observers


@probe
def dspark_sts_recorder():
    import tempfile

    from sglang.srt.speculative.dspark_components.dspark_observability import (
        DsparkStepObservers,
    )

    stem = os.path.join(tempfile.mkdtemp(), "sts")
    bs, gamma = 2, 4
    observers = _step_observers(stem, gamma)
    # compact verify: request 0 verified 2 drafts (both accepted), request 1 verified 4 (1 ok)
    verify_lens = torch.tensor([3, 5])
    DsparkStepObservers.observe_verify_step(
        observers, forward_ct=1, reqs=[], bs=bs, proposal_folded=True,
        verify_ids_2d=torch.zeros(bs, gamma + 1, dtype=torch.int64),
        target_logits=torch.zeros(int(verify_lens.sum()), 16),
        layout=SimpleNamespace(verify_lens=verify_lens), confidence=None,
        confidence_raw=torch.zeros(bs, gamma), prefix_lens=None, draft_tokens=None,
        draft_block=None, sampling_info=None, correct_len=torch.tensor([2, 1]),
        cap_trim_lens=None, bonus=None, commit_lens=None, verify_token_budget=None,
        req_pool_indices=None, verify_tier_num_tokens=0, dp_tier_num_tokens=None,
    )  # fmt: skip
    DsparkStepObservers.note_request_finished(observers, rid="r", natural_stop=True)
    shards = sorted(__import__("glob").glob(stem + ".*"))
    assert shards, "nothing on disk after a finished request"
    shard = torch.load(shards[0], weights_only=True)
    assert shard["prefix_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]], shard["prefix_mask"]
    assert shard["verified"].tolist() == [2, 4]


@probe
def dspark_verify_trace():
    import tempfile

    from sglang.srt.speculative.dspark_components.dspark_observability import (
        DsparkStepObservers,
    )

    stem = os.path.join(tempfile.mkdtemp(), "trace")
    bs, gamma = 2, 4
    observers = _step_observers("", gamma)
    confidence = torch.tensor([[0.9, 0.8, 0.1, 0.1], [0.7, 0.6, 0.5, 0.4]])
    os.environ["SGLANG_DSPARK_VERIFY_TRACE"] = stem
    try:
        DsparkStepObservers.observe_verify_step(
            observers, forward_ct=7, reqs=[], bs=bs, proposal_folded=True,
            verify_ids_2d=torch.zeros(bs, gamma + 1, dtype=torch.int64),
            target_logits=torch.zeros(8, 16),
            layout=SimpleNamespace(verify_lens=torch.tensor([3, 5])), confidence=confidence,
            confidence_raw=None, prefix_lens=None, draft_tokens=None,
            draft_block=None, sampling_info=None, correct_len=torch.tensor([2, 1]),
            cap_trim_lens=None, bonus=None, commit_lens=None, verify_token_budget=6,
            req_pool_indices=None, verify_tier_num_tokens=8, dp_tier_num_tokens=None,
        )  # fmt: skip
    finally:
        os.environ.pop("SGLANG_DSPARK_VERIFY_TRACE", None)
    path = stem + ".rank0.jsonl"
    assert os.path.isfile(path), "no verify trace written"
    with open(path) as f:
        (record,) = [json.loads(line) for line in f]
    assert record["verify_lens"] == [3, 5] and record["accepted"] == [2, 1], record
    assert torch.tensor(record["confidence"]).float().equal(confidence), record["confidence"]
    assert (record["step"], record["budget"], record["tier_tokens"]) == (7, 6, 8), record


# ------------------------------------------------------------------ MTP-1 (EAGLE worker) on CPU


def _resolve_eagle(*spec: str):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args([
        "--model-path", os.environ["PROBE_TARGET"], "--device", "cpu",
        "--attention-backend", "torch_native", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", os.environ["PROBE_MTP_DRAFT"], *spec,
    ])  # fmt: skip
    args.resolve_once()
    return args


@probe
def eagle_cpu_chain_only():
    from sglang.srt.arg_groups.speculative_hook import resolved_view

    mtp1 = resolved_view(_resolve_eagle(
        "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "2",
    ))  # fmt: skip
    assert (mtp1.speculative_eagle_topk, mtp1.speculative_num_draft_tokens) == (1, 2)
    try:
        _resolve_eagle(
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
            "--speculative-num-draft-tokens", "8",
        )  # fmt: skip
    except ValueError as exc:
        assert "--speculative-num-steps 1 --speculative-eagle-topk 1" in str(exc), exc
        return
    raise AssertionError("a top-4 tree was accepted on CPU, whose verify attention is a chain")


@probe
def eagle_torch_native_draft_extend():
    from sglang.srt.speculative import draft_utils

    runner = SimpleNamespace(
        draft_attention_backend="torch_native", device="cpu", req_to_token_pool=None,
        token_to_kv_pool=None, model_config=SimpleNamespace(hf_config=None, hf_text_config=None),
    )  # fmt: skip
    saved = draft_utils.get_spec, draft_utils.attention_backends
    draft_utils.get_spec = lambda: SimpleNamespace(speculative_attention_mode="prefill")
    draft_utils.attention_backends = lambda: ("torch_native", "torch_native")
    try:
        factory = draft_utils.DraftBackendFactory(runner, topk=1, speculative_num_steps=1)
        assert factory.create_decode_backend() is None  # one step: no multi-step backend
        backend = factory.create_draft_extend_backend()
    finally:
        draft_utils.get_spec, draft_utils.attention_backends = saved
    assert type(backend).__name__ == "TorchNativeAttnBackend", backend
    assert backend.prefill_attention_backend_str == "torch_native"


def _chain_tree(bs: int, steps: int, topk: int):
    """The inputs EAGLE's `build_tree_kernel_efficient` receives for a top-1 chain."""
    parents = torch.cat([torch.full((bs, 1), -1), torch.arange(steps)[None].expand(bs, -1)], 1)
    selected = torch.arange(steps)[None].expand(bs, -1).contiguous()
    return parents.long(), selected.long()


@probe
def cpu_eagle_tree_ops():
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode
    from sglang.srt.speculative.eagle_utils import (
        build_tree_kernel_efficient,
        verify_tree_greedy_func,
    )

    bs, n = 2, 2
    parents, selected = _chain_tree(bs, 1, 1)
    seq_lens = torch.tensor([5, 3])
    mask, positions, ridx, rnext, rsib, tokens = build_tree_kernel_efficient(
        torch.tensor([11, 12]), parents, selected, torch.tensor([[21], [22]]), seq_lens,
        int(seq_lens.sum()), 1, 1, n, TreeMaskMode.FULL_MASK,
    )  # fmt: skip
    assert positions.tolist() == [5, 6, 3, 4], positions
    assert ridx.tolist() == [[0, 1], [2, 3]] and rnext.tolist() == [[1, -1], [1, -1]]
    assert tokens.tolist() == [11, 21, 12, 22]
    # each draft row sees its prefix, the bonus slot and itself (a causal chain)
    rows = [mask[: 5 * n + n * n].view(n, 5 + n).tolist()]
    assert rows[0] == [[True] * 5 + [True, False], [True] * 5 + [True, True]], rows
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accepted = torch.empty(bs, dtype=torch.int32)
    target = torch.tensor([[21, 7], [9, 8]])  # request 0 accepts its draft, request 1 does not
    verify_tree_greedy_func(
        predicts, accept_index, accepted, tokens.view(bs, n), ridx, rnext, rsib, target, topk=1
    )
    assert accepted.tolist() == [1, 0] and accept_index.tolist() == [[0, 1], [2, -1]]
    assert predicts.tolist() == [21, 7, 9, 0]


@probe
def cpu_eagle_sampling_verify():
    from sglang.srt.speculative import eagle_utils

    greedy = eagle_utils._verify_uses_greedy(
        is_all_greedy=False, is_cpu=True, is_hip=False, is_xpu=False, use_rejection_sampling=False
    )
    assert not greedy, "temperature-1 requests on CPU are verified greedily (target argmax)"
    assert eagle_utils.tree_speculative_sampling_target_only is not None
    probs = torch.softmax(torch.randn(3, 10), -1)
    top2 = eagle_utils.top_k_renorm_prob(probs, torch.tensor([2, 10, 1]))
    assert (top2[0] > 0).sum() == 2 and (top2[2] > 0).sum() == 1
    torch.testing.assert_close(top2[1], probs[1])
    nucleus = eagle_utils.top_p_renorm_prob(probs, torch.tensor([1e-6, 1.0, 0.5]))
    assert (nucleus[0] > 0).sum() == 1 and torch.allclose(nucleus.sum(-1), torch.ones(3))
    # target-only verification of a chain: a draft with p_t = 1 is always kept, p_t = 0 never
    bs, n, vocab = 2, 2, 5
    target = torch.zeros(bs, n, vocab)
    target[0, 0, 3] = target[1, 0, 1] = 1.0
    target[:, 1] = 0.2
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accepted = torch.empty(bs, dtype=torch.int32)
    eagle_utils.tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accepted,
        candidates=torch.tensor([[0, 3], [0, 4]]), retrive_index=torch.arange(4).view(2, 2),
        retrive_next_token=None, retrive_next_sibling=None, uniform_samples=torch.rand(bs, n),
        uniform_samples_for_final_sampling=torch.rand(bs), target_probs=target,
        draft_probs=torch.zeros_like(target), threshold_single=1.0, threshold_acc=1.0,
        deterministic=True,
    )  # fmt: skip
    assert accepted.tolist() == [1, 0] and predicts[2].item() == 1, (accepted, predicts)


@probe
def cpu_row_argmax():
    from sglang.srt.speculative.spec_utils import fast_sample

    probs = torch.softmax(torch.randn(4, 3000), -1)
    p, idx = fast_sample(probs)
    assert idx.shape == (4, 1) and torch.equal(p, probs.gather(1, idx))


@probe
def cpu_half_gemm_fp32():
    """A 16-row bf16 linear and LM head, with the hook's float32 path forced (`auto` takes it
    only where oneDNN has no bf16 GEMM)."""
    import torch.nn.functional as F
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.quantization.unquant import (
        UnquantizedEmbeddingMethod,
        UnquantizedLinearMethod,
    )

    from sglang_dspark.plugin import cpu_gemm

    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(1536, 576, generator=g).bfloat16(), False)
    layer.quant_method = UnquantizedEmbeddingMethod()
    x = torch.randn(16, 576, generator=g).bfloat16()
    want = F.linear(x.float(), layer.weight.float()).bfloat16()
    proc = LogitsProcessor.__new__(LogitsProcessor)
    proc.use_fp32_lm_head, proc.use_fp32_lm_head_output, proc.rl_on_policy_target = (
        False,
        False,
        None,
    )
    os.environ[cpu_gemm.MODE_ENV] = "float32"
    cpu_gemm.settings.cache_clear()
    try:
        out = UnquantizedLinearMethod().apply(layer, x)
        logits = proc._compute_lm_head(x, layer)
    finally:
        del os.environ[cpu_gemm.MODE_ENV]
        cpu_gemm.settings.cache_clear()
    assert torch.equal(out, want), "a 16-row bf16 linear ran torch's bf16 GEMM"
    assert torch.equal(logits, want), "a 16-row bf16 LM head ran torch's bf16 GEMM"


# ------------------------------------------------------------------ DeepSeek-V4 on CPU
def _v4_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.environ["PROBE_V4"])


@probe
def v4_cpu_defaults():
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_dspark.plugin.v4_cpu_defaults import CPU_ENV

    saved = {n: os.environ.pop(n) for n in CPU_ENV if n in os.environ}
    try:
        args = prepare_server_args(["--model-path", os.environ["PROBE_V4"], "--device", "cpu"])
        args.resolve_once()
        env = {n: os.environ.get(n) for n in CPU_ENV}
    finally:
        for n in CPU_ENV:
            os.environ.pop(n, None)
        os.environ.update(saved)
    view = resolved_view(args)
    topk = (view.dsa_topk_backend, view.speculative_dsa_topk_backend)
    want = {n: "1" if v else "0" for n, v in CPU_ENV.items()}
    assert env == want and topk == ("torch", "torch"), (
        f"DeepSeek-V4 --device cpu resolved with {env}, top-k backends {topk}: the server dies "
        "at its first forward in CUDA kernels (DeepGEMM logits, sgl-kernel top-k, TileLang mHC)"
    )


@probe
def v4_foreign_tokenizer_chat():
    from sglang.srt.entrypoints.openai import chat_encoding
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.environ["PROBE_V4"])
    spec = chat_encoding.resolve_chat_encoding_spec(hf_config=_v4_config(), tokenizer=tokenizer)
    if spec is not None:  # what the HTTP server's start-up does with it
        from sglang.srt.parser.deepseek_recipe_renderer import DeepSeekRecipe

        recipe = DeepSeekRecipe.from_hf_tokenizer(spec, tokenizer)
        recipe.encode({"messages": [{"role": "user", "content": ""}], "thinking": True})
        raise AssertionError(f"the {spec} recipe encoded a prompt with a SmolLM2 tokenizer")


@probe
def v4_cpu_plain_rope():
    from sglang.srt.layers.rotary_embedding.factory import get_rope_wrapper

    try:
        rope = get_rope_wrapper(head_size=64, rotary_dim=64, max_position=4096, base=10000,
                                rope_scaling=None, is_neox_style=False, device="cpu")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(
            "get_rope_cpu asserts on rope_scaling=None (MQALayer's sliding-window layers)"
        ) from exc
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq
    want = torch.cat([angles.cos(), angles.sin()], dim=-1)
    torch.testing.assert_close(rope.cos_sin_cache.float(), want, rtol=0, atol=1e-5)


@probe
def v4_cpu_fp8_kv_pool():
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    sizes = SimpleNamespace(max_total_num_tokens=512, max_running_requests=2,
                            full_max_total_num_tokens=512, swa_max_total_num_tokens=256)  # fmt: skip
    pools = SimpleNamespace(req_to_token_pool="r2t", token_to_kv_pool="v4 pool",
                            token_to_kv_pool_allocator=object(), unified_memory_pool=None)  # fmt: skip

    def configurator(hf_config):
        return SimpleNamespace(
            kv_cache_dtype=torch.float8_e4m3fn, model_config=SimpleNamespace(hf_config=hf_config),
            use_mla_backend=False, spec_algorithm=SimpleNamespace(is_none=lambda: True),
            is_draft_worker=False, memory_pool_config=None, device="cpu", gpu_id=0,
            req_to_token_pool=None, token_to_kv_pool_allocator=None,
            _resolve_memory_pool_config=lambda memory: "config",
            _derive_pool_sizes=lambda config: sizes, _init_pools=lambda **kw: pools,
        )  # fmt: skip

    result = KVCacheConfigurator.configure(configurator(_v4_config()), pre_model_load_memory=0)
    assert result.token_to_kv_pool == "v4 pool" and result.max_total_num_tokens == 512
    # any other model keeps upstream's refusal of an fp8 cache the CPU attention cannot read
    other = SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama")
    with contextlib.suppress(ValueError):
        KVCacheConfigurator.configure(configurator(other), pre_model_load_memory=0)
        raise AssertionError("an fp8 KV cache for a non-V4 model was allowed on CPU")


@probe
def v4_cpu_compression_metadata():
    from sglang.kernels.ops.attention.dsv4.metadata_kernel import init_compression_metadata

    seq_lens = torch.tensor([4, 130, 7, 256], dtype=torch.int32)
    positions = seq_lens - 1
    out_loc = torch.tensor([3, 2049, 518, 767], dtype=torch.int64)
    page_table = torch.tensor([[0, 5], [2, 3], [1, 4], [7, 6]], dtype=torch.int32)
    c4_loc, c4_pos, c4_raw, c4_len, c128_loc, c128_pos, c128_raw, c128_len, c128_pages = (
        init_compression_metadata(seq_lens, positions, out_loc, page_table, 256)
    )
    assert c4_loc.tolist() == [0, 0, 0, 191] and c4_raw.tolist() == [1, 32, 1, 64]
    assert c4_len.tolist() == [1, 32, 1, 64] and c4_pos.tolist() == [0, 128, 4, 252]
    assert c128_loc.tolist() == [0, 0, 0, 5] and c128_raw.tolist() == [0, 1, 0, 2]
    assert c128_len.tolist() == [1, 1, 1, 2] and c128_pos.tolist() == [0, 128, 0, 128]
    # two compressed slots per 256-token page: page p holds slots 2p, 2p + 1
    assert c128_pages.tolist() == [[-1] * 4, [4, -1, -1, -1], [-1] * 4, [14, 15, -1, -1]]


def _v4_cache(num_pages, page_size):
    from dspark_kernels.kv_layout import new_v4_cache

    return new_v4_cache(num_pages, page_size)


@probe
def v4_cpu_sparse_attention():
    from dspark_kernels.kv_layout import dequantize_v4_rows
    from dspark_kernels.kv_store import kv_norm_rope_store_reference
    from sglang.srt.layers.attention import deepseek_v4_backend

    assert deepseek_v4_backend._create_flashmla_metadata() is None
    from sglang_dspark.plugin.v4_cpu_attention import flash_mla_with_kvcache_torch

    torch.manual_seed(0)
    heads, swa_page, extra_page = 4, 256, 64
    swa, extra = _v4_cache(2, swa_page), _v4_cache(2, extra_page)
    freqs = torch.polar(torch.ones(64, 32), torch.randn(64, 32))
    for cache, page, n in ((swa, swa_page, 300), (extra, extra_page, 100)):
        kv = torch.randn(n, 512)
        kv_norm_rope_store_reference(kv, torch.ones(512), 1e-6, freqs, torch.arange(n) % 64,
                                     torch.arange(n), cache, page)  # fmt: skip
    q = torch.randn(3, 1, heads, 512, dtype=torch.bfloat16)
    sink = torch.randn(heads)
    idx = torch.full((3, 1, 64), -1, dtype=torch.int32)
    idx[0, 0, :5] = torch.tensor([0, 1, 2, 3, 4])
    idx[1, 0, :3] = torch.tensor([257, 260, 299])
    extra_idx = torch.full((3, 1, 64), -1, dtype=torch.int32)
    extra_idx[0, 0, :2] = torch.tensor([7, 70])
    lens, extra_lens = torch.tensor([5, 3, 1]), torch.tensor([2, 1, 1])
    out, _ = flash_mla_with_kvcache_torch(
        q=q, k_cache=swa[:, : swa_page * 584].view(2, swa_page, 1, 584), head_dim_v=512,
        softmax_scale=512**-0.5, indices=idx, topk_length=lens, attn_sink=sink,
        extra_k_cache=extra[:, : extra_page * 584].view(2, extra_page, 1, 584),
        extra_indices_in_kvcache=extra_idx, extra_topk_length=extra_lens,
    )  # fmt: skip
    for row, (rows, extra_rows) in enumerate([([0, 1, 2, 3, 4], [7, 70]), ([257, 260, 299], [])]):
        keys = dequantize_v4_rows(swa, torch.tensor(rows), swa_page)
        if extra_rows:
            keys = torch.cat(
                [keys, dequantize_v4_rows(extra, torch.tensor(extra_rows), extra_page)]
            )
        scores = q[row, 0].float() @ keys.T * 512**-0.5  # [heads, keys]
        weights = torch.exp(scores - torch.logaddexp(scores.logsumexp(-1), sink)[:, None])
        torch.testing.assert_close(out[row, 0].float(), (weights @ keys).to(torch.bfloat16).float(),
                                   rtol=2e-2, atol=2e-2)  # fmt: skip
    assert out[2].abs().max() == 0  # no valid slot: 0, as FlashMLA
    # the DSpark draft pads its query to more heads than it has sinks: same real heads
    q_pad = torch.cat([q, torch.full_like(q, float("nan"))], dim=2)
    padded, _ = flash_mla_with_kvcache_torch(
        q=q_pad, k_cache=swa[:, : swa_page * 584].view(2, swa_page, 1, 584), head_dim_v=512,
        softmax_scale=512**-0.5, indices=idx, topk_length=lens, attn_sink=sink,
    )  # fmt: skip
    plain, _ = flash_mla_with_kvcache_torch(
        q=q, k_cache=swa[:, : swa_page * 584].view(2, swa_page, 1, 584), head_dim_v=512,
        softmax_scale=512**-0.5, indices=idx, topk_length=lens, attn_sink=sink,
    )  # fmt: skip
    assert torch.equal(padded[:, :, :heads], plain) and padded[:, :, heads:].abs().max() == 0


def _fake_v4_pool(num_slots: int):
    return SimpleNamespace(full_to_swa_index_mapping=torch.arange(num_slots), swa_page_size=256,
                           get_ring_size=lambda compress_ratio: 8 if compress_ratio == 4 else 128,
                           _unified_kv=False)  # fmt: skip


@probe
def v4_cpu_compressor():
    from dspark_kernels.compressor import compress_verify_reference
    from dspark_kernels.ragged_plan import StateAddressing
    from sglang.kernels.ops.attention.dsv4 import compress_forward, compress_norm_rope_store
    from sglang.srt.layers.attention.dsv4.compressor_v2 import create_paged_compressor_data

    torch.manual_seed(0)
    # two requests: 6 tokens after 5 cached, and a fresh 9-token prompt (C4, window 8)
    prefix, extend = [5, 0], [6, 9]
    seq = [p + e for p, e in zip(prefix, extend)]
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[0, :11] = torch.arange(11)
    req_to_token[1, :9] = torch.arange(256, 265)
    pool = _fake_v4_pool(512)
    plan = create_paged_compressor_data(
        4, is_prefill=True, token_to_kv_pool=pool, req_to_token=req_to_token,
        req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(seq),
        extend_lens=torch.tensor(extend), seq_lens_cpu=seq, extend_lens_cpu=extend,
    )  # fmt: skip
    kv_score = torch.randn(sum(extend), 4 * 512)
    state = torch.randn(2 * 8 * 2, 4 * 512)  # the state ring's earlier rows hold old tokens
    ape, weight = torch.randn(8, 512), torch.rand(512) + 0.5
    freqs = torch.polar(torch.ones(64, 32), torch.randn(64, 32))
    out_loc = torch.arange(sum(extend)) // 4 + 3
    ours_state, ours_cache = state.clone(), _v4_cache(1, 64)
    rows = compress_forward(ours_state.view(-1, 4, 4 * 512), kv_score, ape, plan, head_dim=512,
                            compress_ratio=4)  # fmt: skip
    compress_norm_rope_store(rows, plan, norm_weight=weight, norm_eps=1e-6, freq_cis=freqs,
                             out_loc=out_loc, kvcache=ours_cache, page_size=64)  # fmt: skip
    ref_state, ref_cache = state.clone(), _v4_cache(1, 64)
    addr = StateAddressing(torch.tensor([0, 1]), req_to_token, pool.full_to_swa_index_mapping,
                           256, 8)  # fmt: skip
    ref = compress_verify_reference(kv_score, ref_state, ape, extend, prefix, addr, 4, weight,
                                    1e-6, freqs, out_loc, ref_cache, 64)  # fmt: skip
    assert rows.shape[0] == len(ref) == 3  # positions 7 (request 0), 3 and 7 (request 1)
    torch.testing.assert_close(rows, torch.stack(list(ref.values())), rtol=1e-5, atol=1e-6)
    assert torch.equal(ours_state, ref_state) and torch.equal(ours_cache, ref_cache)


@probe
def v4_cpu_norm_rope():
    from dspark_kernels.kv_layout import dequantize_v4_rows
    from sglang.kernels.ops.attention.dsv4.norm_rope import (
        fused_k_norm_rope_flashmla,
        fused_q_norm_rope,
        fused_rope_inplace,
    )

    torch.manual_seed(0)
    freqs = torch.polar(torch.ones(32, 32), torch.randn(32, 32))
    pos = torch.tensor([0, 5, 31])
    q = torch.randn(3, 4, 512, dtype=torch.bfloat16)
    q_out = torch.empty_like(q)
    fused_q_norm_rope(q, q_out, 1e-6, freqs, pos)
    normed = q.float() * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    tail = torch.view_as_complex(
        normed.to(torch.bfloat16).float()[..., 448:].unflatten(-1, (32, 2))
    )
    want = torch.cat(
        [normed[..., :448], torch.view_as_real(tail * freqs[pos][:, None]).flatten(-2)], -1
    )
    torch.testing.assert_close(q_out.float(), want, rtol=1e-2, atol=1e-2)
    undo = q_out[..., 448:].clone()
    fused_rope_inplace(undo, None, freqs, pos, inverse=True)
    torch.testing.assert_close(undo.float(), normed[..., 448:], rtol=2e-2, atol=2e-2)
    kv, cache = torch.randn(3, 512, dtype=torch.bfloat16), _v4_cache(1, 256)
    fused_k_norm_rope_flashmla(kv, torch.ones(512), 1e-6, freqs, pos, torch.tensor([4, 9, 200]),
                               cache, 256)  # fmt: skip
    stored = dequantize_v4_rows(cache, torch.tensor([4, 9, 200]), 256)
    kv_normed = kv.float() * torch.rsqrt(kv.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(stored[:, :448], kv_normed[:, :448], rtol=0.07, atol=0.02)


@probe
def v4_cpu_index_topk():
    from dspark_kernels import index_topk
    from sglang.srt.layers.attention.dsv4 import indexer

    torch.manual_seed(0)
    scores = torch.randn(3, 100)
    seq_lens = torch.tensor([100, 10, 70], dtype=torch.int32)
    page_table = torch.tensor([[3, 1], [0, 0], [2, 5]], dtype=torch.int32)
    slots, raw = torch.empty(3, 16, dtype=torch.int32), torch.empty(3, 16, dtype=torch.int32)
    calls, reference = [], index_topk.topk_transform_reference
    index_topk.topk_transform_reference = lambda *a, **k: calls.append(1) or reference(*a, **k)
    try:
        indexer.topk_transform_pytorch_vectorized(scores, seq_lens, page_table, slots, 64, raw)
    finally:
        index_topk.topk_transform_reference = reference
    want_slots, want_raw = reference(scores, seq_lens, page_table, 16)
    assert torch.equal(slots, want_slots) and torch.equal(raw, want_raw)  # SGLang's selection
    assert calls, "the C4 indexer's top-k ran SGLang's torch top-k, no dspark_kernels call"


@probe
def v4_cpu_index_live_pages():
    import inspect

    from sglang.srt.layers.attention.dsv4 import indexer

    torch.manual_seed(0)
    cache = torch.zeros(4, 64 * 132, dtype=torch.uint8)
    cache[:, : 64 * 128] = (
        torch.randn(4, 64 * 128).clamp(-4, 4).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    cache[:, 64 * 128 :] = torch.ones(4, 64).view(torch.uint8).view(4, -1)  # scales 1.0
    cache = cache.view(4, 64, 1, 132)
    q = torch.randn(3, 1, 8, 128).to(torch.float8_e4m3fn)
    weight, seq_lens = torch.randn(3, 8), torch.tensor([3, 0, 70], dtype=torch.int32)
    table = torch.tensor([[1, 2, 10**6], [2, 0, 10**6], [3, 0, 10**6]], dtype=torch.int32)
    try:  # column 2 lies past every row's length (at most two pages); its id is no page
        got = indexer.fp8_paged_mqa_logits_torch(q, cache, weight, seq_lens, table, None, 70, False)
    except IndexError as exc:
        raise AssertionError(
            f"the indexer gathered page-table columns past every row's length ({exc})"
        ) from None
    upstream = inspect.unwrap(indexer.fp8_paged_mqa_logits_torch)
    assert torch.equal(got, upstream(q, cache, weight, seq_lens, table[:, :2], None, 70, False))


@probe
def v4_cpu_mhc():
    from sglang.kernels.ops.layernorm.mhc import _mhc_pre_torch, hc_split_sinkhorn, mhc_combine
    from sglang.kernels.ops.layernorm.mhc_head import fused_hc_head
    from sglang.srt.models.deepseek_v4 import hc_head_torch

    torch.manual_seed(0)
    hc, hidden, tokens = 4, 16, 3
    residual = torch.randn(tokens, hc, hidden)
    fn, base, scale = torch.randn(24, hc * hidden) * 0.1, torch.randn(24), torch.rand(3)
    x_flat = residual.flatten(1)
    rsqrt = torch.rsqrt(x_flat.square().mean(-1, keepdim=True) + 1e-6)
    mixes = torch.nn.functional.linear(x_flat, fn) * rsqrt
    try:
        pre, post, comb = hc_split_sinkhorn(mixes.unsqueeze(1), scale, base, hc, 20, 1e-6)
    except Exception as exc:  # noqa: BLE001 - TileLang's CUDA build error dumps the kernel source
        raise RuntimeError(f"hc_split_sinkhorn's TileLang kernel failed on CPU ({exc!r:.80})")
    want_post, want_comb, want_y = _mhc_pre_torch(residual, fn, scale, base, 1e-6, 1e-6, 1e-6,
                                                  2.0, 20)  # fmt: skip
    torch.testing.assert_close(comb.squeeze(1), want_comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post.squeeze(1), want_post.squeeze(-1), rtol=1e-5, atol=1e-6)
    y = mhc_combine(x_flat, pre.squeeze(1), hc, torch.float32)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    head_fn, head_base, head_scale = torch.randn(hc, hc * hidden), torch.randn(hc), torch.rand(1)
    head = fused_hc_head(residual.bfloat16(), head_fn, head_scale, head_base, 1e-6, 1e-6)
    want = hc_head_torch(residual.bfloat16(), head_fn, head_scale, head_base, norm_eps=1e-6,
                         hc_eps=1e-6)  # fmt: skip
    torch.testing.assert_close(head, want)


@probe
def v4_cpu_swiglu_clamp():
    from sglang.kernels.ops.activation.silu_and_mul_clamp import silu_and_mul_clamp
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    torch.manual_seed(0)
    limit = 1.0

    def clamped(gate_up):
        gate, up = gate_up.float().chunk(2, -1)
        return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)

    tokens, hidden, inter, experts = 6, 8, 4, 3
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) * 2  # branches past 1
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16)
    layer = SimpleNamespace(num_experts=experts, w13_weight=w13, w2_weight=w2)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    weights = torch.rand(tokens, 2)
    config = MoeRunnerConfig(activation="silu", swiglu_limit=limit)
    out = moe_forward_native(layer, x, (weights, ids, None), config)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(2):
            e = ids[t, k]
            act = clamped(x[t : t + 1] @ w13[e].T).to(torch.bfloat16)
            want[t] += weights[t, k] * (act @ w2[e].T).float()[0]
    assert torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2), (
        "moe_forward_native ignored swiglu_limit: the routed experts ran an unclamped SwiGLU "
        f"(max error {(out.float() - want).abs().max():.3f})"
    )
    shared = torch.randn(tokens, 2 * inter, dtype=torch.bfloat16) * 3
    act = torch.empty(tokens, inter, dtype=torch.bfloat16)
    silu_and_mul_clamp(shared, act, limit)
    torch.testing.assert_close(act, clamped(shared).to(torch.bfloat16))


@probe
def cpu_paged_last_loc():
    from sglang.kernels.ops.memory.common import get_last_loc_triton

    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    last = get_last_loc_triton(req_to_token, torch.tensor([2, 0, 3]), torch.tensor([5, 0, 10]))
    assert last.tolist() == [24, -1, 39] and last.dtype == torch.int64


@probe
def v4_cpu_pinned_lists():
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    backend = SimpleNamespace(device=torch.device("cpu"))
    lens = DeepseekV4AttnBackend._move_to_device(backend, [5, 5, 3])
    assert lens.tolist() == [5, 5, 3] and lens.dtype == torch.int32


@probe
def v4_validation():
    import tempfile
    from pathlib import Path

    from sglang.srt.server_args import prepare_server_args

    src = Path(os.environ["PROBE_V4"])
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp)
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                (bad / f.name).symlink_to(f.resolve())
        cfg = json.loads((src / "config.json").read_text())
        cfg["compress_ratios"] = [0, 8, 128, 4]
        (bad / "config.json").write_text(json.dumps(cfg))
        args = prepare_server_args(["--model-path", str(bad), "--device", "cpu"])
        try:
            args.resolve_once()
        except Exception as exc:
            if "layer 1: 8" in str(exc) and "supports [0, 4, 128]" in str(exc):
                return
            raise AssertionError(
                f"compress_ratios [0, 8, 128, 4]: {type(exc).__name__}: {exc}, no message "
                "naming the layer and the supported ratios"
            ) from exc
    raise AssertionError("compress_ratios [0, 8, 128, 4] resolved without a refusal")


def _resolve(draft: str):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args([
        "--model-path", os.environ["PROBE_TARGET"], "--device", "cpu",
        "--attention-backend", "torch_native", "--speculative-algorithm", "DSPARK",
        "--speculative-draft-model-path", draft,
    ])  # fmt: skip
    args.resolve_once()
    return args


if __name__ == "__main__":
    names = sys.argv[1:] or list(PROBES)
    for name in names:
        try:
            PROBES[name]()
            result = {"probe": name, "ok": True, "error": ""}
        except Exception as exc:  # noqa: BLE001 - report, do not stop: every probe is run
            result = {"probe": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc(limit=3)}  # fmt: skip
        print("PROBE " + json.dumps(result), flush=True)

"""(a) The C4 / C128 compressor on a ragged verify batch, and the plan it runs from.

Verify lengths 1 .. gamma + 1 mixed in one batch; groups closing at every offset of the verify
block, the first group of a request (no compressed history before it), windows reaching across
256-token pages into the previous page's ring, and padding tokens. Triton under Triton's
interpreter on CPU (compiled on a GPU) against the torch reference, which is driven by SGLang's
compact plans; on a GPU also against SGLang's `compress_forward` + `compress_norm_rope_store`.
"""

import pytest
import torch
from dspark_kernels import compressor, kv_layout, ragged_plan
from kernel_interpreter import DEVICE, direct, interpreter_test, needs_gpu

test_in_triton_interpreter = interpreter_test(__file__)


PAGE = 256
TOKENS_PER_REQ = 1024
PAD = 2  # graph padding tokens after the batch
# C4: pos 3 closes a request's first group (no overlap, empty history); 250.., 254.. close
# groups next to / across a page end; 7 and 1015 close one at the block's first token.
C4_BATCH = ([1, 6, 6, 5, 2, 4, 6, 3], [3, 250, 254, 7, 0, 509, 1015, 61])
# C128: groups close at block offsets 2, 0, 3 and 4; two requests close none.
C128_BATCH = ([6, 1, 4, 3, 2, 5], [125, 127, 252, 0, 380, 507])


def freqs_cis(max_pos: int, theta: float = 160000.0) -> torch.Tensor:
    inv = theta ** (-torch.arange(0, 32, dtype=torch.float64) / 32)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def setup(ratio, head_dim, batch, input_dtype, state_dtype, use_req_ring=False, seed=0):
    verify_lens, prefix_lens = batch
    gen = torch.Generator().manual_seed(seed)
    reqs = len(verify_lens)
    pages_per_req = TOKENS_PER_REQ // PAGE
    num_pages = (reqs + 1) * pages_per_req
    perm = torch.randperm(num_pages, generator=gen)
    rid = torch.arange(reqs, dtype=torch.int64) + 1  # pool rows differ from batch indices
    req_to_token = torch.zeros(reqs + 1, TOKENS_PER_REQ, dtype=torch.int32)
    p = torch.arange(TOKENS_PER_REQ)
    for b in range(reqs):
        pages = perm[b * pages_per_req : (b + 1) * pages_per_req]
        req_to_token[rid[b]] = (pages[p // PAGE] * PAGE + p % PAGE).to(torch.int32)
    ring = 16 if ratio == 4 else 256  # speculative rings (`get_compress_state_ring_size`)
    addr = ragged_plan.StateAddressing(
        req_pool_indices=rid,
        req_to_token=req_to_token,
        full_to_swa=torch.arange(num_pages * PAGE, dtype=torch.int64),
        swa_page_size=PAGE,
        ring_size=ring,
        use_req_ring=use_req_ring,
    )
    state_rows = (reqs + 1) * ring if (ratio == 128 or use_req_ring) else num_pages * ring
    row = (4 if ratio == 4 else 2) * head_dim
    tokens = sum(verify_lens) + PAD
    raw = torch.zeros(tokens, dtype=torch.int64)
    t = 0
    for b, (n, prefix) in enumerate(zip(verify_lens, prefix_lens)):
        raw[t : t + n] = req_to_token[rid[b], prefix : prefix + n].long()
        t += n
    plan = ragged_plan.ragged_verify_plan_reference(verify_lens, prefix_lens, tokens, raw)
    window = 8 if ratio == 4 else 128
    inputs = {
        "kv_score": torch.randn(tokens, row, generator=gen).to(input_dtype),
        "state": torch.randn(state_rows, row, generator=gen).to(state_dtype),
        "ape": torch.randn(window, head_dim, generator=gen) * 0.5,
        "ratio": ratio,
        "norm_weight": 1 + 0.2 * torch.randn(head_dim, generator=gen),
        "norm_eps": 1e-6,
        "freqs_cis": freqs_cis(TOKENS_PER_REQ),
        "out_loc": plan.c4_out_loc if ratio == 4 else plan.c128_out_loc,
    }
    if head_dim == 512:
        cache_page = PAGE // ratio
        cache = kv_layout.new_v4_cache(num_pages, cache_page)
    else:
        cache_page = kv_layout.INDEX_PAGE_SIZE
        cache = kv_layout.new_index_cache(num_pages)
    return plan, addr, inputs, cache, cache_page, raw


def to_device(x):
    """A copy on DEVICE (a copy on CPU too: the kernel and the reference update their own)."""
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE, copy=True)
    if isinstance(x, (ragged_plan.RaggedVerifyPlan, ragged_plan.StateAddressing)):
        return type(x)(**{k: to_device(v) for k, v in vars(x).items()})
    return x


def run_both(ratio, head_dim, batch, input_dtype, state_dtype, use_req_ring=False):
    plan, addr, inputs, cache, cache_page, raw = setup(
        ratio, head_dim, batch, input_dtype, state_dtype, use_req_ring
    )
    dev_inputs = {k: to_device(v) for k, v in inputs.items()}
    dev_cache = to_device(cache)
    device_plan = ragged_plan.ragged_verify_plan(
        torch.tensor(batch[0], device=DEVICE), torch.tensor(batch[1], device=DEVICE),
        plan.num_tokens, raw.to(DEVICE),
    )  # fmt: skip
    for field, want in vars(plan).items():
        assert torch.equal(
            getattr(device_plan, field).cpu(), want.to(getattr(device_plan, field).dtype)
        ), field
    rows = compressor.compress_verify(
        plan=device_plan, addr=to_device(addr), cache=dev_cache, page_size=cache_page, **dev_inputs
    )
    ref_rows = compressor.compress_verify_reference(
        verify_lens=batch[0], prefix_lens=batch[1], addr=addr, cache=cache, page_size=cache_page,
        **inputs,
    )  # fmt: skip
    return (
        rows.cpu(),
        ref_rows,
        dev_inputs["state"].cpu(),
        inputs["state"],
        dev_cache.cpu(),
        cache,
        plan,
    )


def assert_rows_close(rows, ref_rows, input_dtype):
    assert ref_rows, "the batch closes no group"
    ids = torch.tensor(list(ref_rows))
    rtol, atol = (2**-7, 1e-3) if input_dtype == torch.bfloat16 else (1e-5, 1e-5)
    want = torch.stack(list(ref_rows.values()))
    torch.testing.assert_close(rows[ids], want, rtol=rtol, atol=atol)


def assert_v4_close(got, want, page_size):
    differ = int((got != want).sum())
    written = int((want != 0).any(dim=1).sum()) * page_size * kv_layout.V4_TOKEN_BYTES
    assert written > 0, "nothing was stored"
    assert differ <= 0.002 * max(written, 1), f"{differ} bytes differ"
    live = torch.arange(got.shape[0] * page_size)
    g, w = (
        kv_layout.dequantize_v4_rows(got, live, page_size),
        kv_layout.dequantize_v4_rows(want, live, page_size),
    )
    torch.testing.assert_close(g, w, rtol=0.13, atol=1e-3)


def assert_index_close(got, want):
    live = torch.arange(got.shape[0] * kv_layout.INDEX_PAGE_SIZE)
    g_codes, g_scale = kv_layout.read_index_rows(got, live)
    w_codes, w_scale = kv_layout.read_index_rows(want, live)
    torch.testing.assert_close(g_scale, w_scale, rtol=1e-5, atol=0)
    assert float((g_codes != w_codes).float().mean()) < 0.002
    g = g_codes.view(torch.float8_e4m3fn).float()
    w = w_codes.view(torch.float8_e4m3fn).float()
    assert bool(((g - w).abs() <= w.abs() / 8 + 2**-9).all())


@pytest.mark.parametrize(
    "input_dtype,state_dtype,use_req_ring",
    [
        (torch.float32, torch.float32, False),  # SGLang's dtypes (linear_bf16_fp32, fp32 state)
        (torch.bfloat16, torch.float32, False),  # state rounded to the input dtype when read
        (torch.float32, torch.bfloat16, True),  # state rounded when written; request ring
    ],
)
@direct
def test_c4_kv_matches_reference(input_dtype, state_dtype, use_req_ring):
    rows, ref_rows, state, ref_state, cache, ref_cache, _ = run_both(
        4, 512, C4_BATCH, input_dtype, state_dtype, use_req_ring
    )
    assert_rows_close(rows, ref_rows, input_dtype)
    assert torch.equal(state, ref_state)
    assert_v4_close(cache, ref_cache, PAGE // 4)


@direct
def test_c4_indexer_matches_reference():
    rows, ref_rows, state, ref_state, cache, ref_cache, _ = run_both(
        4, 128, C4_BATCH, torch.float32, torch.float32
    )
    assert_rows_close(rows, ref_rows, torch.float32)
    assert torch.equal(state, ref_state)
    assert_index_close(cache, ref_cache)


@direct
@pytest.mark.slow
def test_c128_kv_matches_reference():
    rows, ref_rows, state, ref_state, cache, ref_cache, _ = run_both(
        128, 512, C128_BATCH, torch.float32, torch.float32
    )
    assert_rows_close(rows, ref_rows, torch.float32)
    assert torch.equal(state, ref_state)
    assert_v4_close(cache, ref_cache, PAGE // 128)


@direct
def test_plans_cover_the_ragged_cases():
    """The batches exercise what the issue asks for, read off SGLang's plans."""
    _, addr, *_ = setup(4, 512, C4_BATCH, torch.float32, torch.float32)
    plan_c, plan_w = ragged_plan.compress_plans_reference(*C4_BATCH, 4, addr)
    seq_len, _, buffer_len = plan_c[:, 0], plan_c[:, 1], plan_c[:, 2]
    assert bool((seq_len == 4).any())  # a first group: no compressed history
    assert set(buffer_len.tolist()) >= {7, 6, 3, 2}  # closing at block offsets 0, 1, 4, 5
    assert bool(((seq_len - 1) % PAGE < 8).any())  # a window reaching into the previous page
    assert plan_w.shape[0] > 0
    _, addr128, *_ = setup(128, 512, C128_BATCH, torch.float32, torch.float32)
    plan_c, _ = ragged_plan.compress_plans_reference(*C128_BATCH, 128, addr128)
    assert set(plan_c[:, 2].tolist()) == {127 - j for j in (2, 0, 3, 4)}


@needs_gpu
@pytest.mark.parametrize("ratio,head_dim", [(4, 512), (4, 128), (128, 512)])
def test_matches_sglang_compressor(ratio, head_dim):
    from sglang.kernels.ops.attention.dsv4 import (
        CompressorPrefillPlan,
        compress_forward,
        compress_norm_rope_store,
    )

    batch = C4_BATCH if ratio == 4 else C128_BATCH
    plan, addr, inputs, cache, cache_page, _ = setup(
        ratio, head_dim, batch, torch.float32, torch.float32, seed=5
    )
    total = sum(batch[0])
    theirs_plan = CompressorPrefillPlan.generate(
        compress_ratio=ratio,
        req_pool_indices=addr.req_pool_indices.cuda(),
        seq_lens=torch.tensor([p + n for n, p in zip(*batch)], dtype=torch.int64),
        extend_lens=torch.tensor(batch[0], dtype=torch.int64),
        req_to_token=addr.req_to_token.cuda(),
        full_to_state=addr.full_to_swa.cuda(),
        swa_page_size=addr.swa_page_size,
        ring_size=addr.ring_size,
        num_q_tokens=total,
    )
    plan_c, plan_w = ragged_plan.compress_plans_reference(*batch, ratio, addr)
    want_c, want_w = ragged_plan.pack_compress_plans(plan_c, plan_w)
    assert torch.equal(theirs_plan.plan_c.cpu(), want_c)
    assert torch.equal(theirs_plan.plan_w.cpu(), want_w)

    theirs_state = inputs["state"].cuda()
    theirs_cache = cache.cuda()
    kv_score = inputs["kv_score"].cuda()
    row = kv_score.shape[1]
    compact = compress_forward(
        theirs_state.view(-1, ratio, row), kv_score[:total], inputs["ape"].cuda(), theirs_plan,
        head_dim=head_dim, compress_ratio=ratio,
    )  # fmt: skip
    compress_norm_rope_store(
        compact, theirs_plan, norm_weight=inputs["norm_weight"].cuda(), norm_eps=1e-6,
        freq_cis=inputs["freqs_cis"].cuda(), out_loc=inputs["out_loc"][:total].cuda(),
        kvcache=theirs_cache, page_size=cache_page,
    )  # fmt: skip

    dev_inputs = {k: to_device(v) for k, v in inputs.items()}
    ours_cache = cache.cuda()
    rows = compressor.compress_verify(
        plan=to_device(plan), addr=to_device(addr), cache=ours_cache, page_size=cache_page,
        **dev_inputs,
    )  # fmt: skip
    torch.testing.assert_close(rows[plan_c[:, 1].cuda()], compact, rtol=1e-5, atol=1e-5)
    assert torch.equal(dev_inputs["state"], theirs_state)
    if head_dim == 512:
        assert_v4_close(ours_cache.cpu(), theirs_cache.cpu(), cache_page)
    else:
        assert_index_close(ours_cache.cpu(), theirs_cache.cpu())

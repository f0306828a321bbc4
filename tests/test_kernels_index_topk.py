"""(c) Ragged paged fp8 index logits fused with the per-row top-k.

One row per verify token, each with its own compressed length `(position + 1) // 4`: rows with
no compressed history, rows shorter than top-k (taken whole, in order) and rows longer than
top-k whose pages are scattered. Triton under Triton's interpreter on CPU (compiled on a GPU)
against the torch reference; on a GPU also against DeepGEMM's `fp8_paged_mqa_logits` followed
by SGLang's `topk_transform_paged`. Equal logits may be selected differently, so selections are
compared by the logits they pick.
"""

import pytest
import torch
from dspark_kernels import index_topk, kv_layout, ragged_plan
from kernel_interpreter import DEVICE, direct, interpreter_test, needs_gpu

test_in_triton_interpreter = interpreter_test(__file__)


HEADS = 64
CPAGE = 64  # compressed tokens per indexer page (256 / 4)


def indexer_batch(verify_lens, prefix_lens, num_pages, seed=0):
    """Rows of a ragged verify batch and an indexer cache of random fp8 keys."""
    gen = torch.Generator().manual_seed(seed)
    plan = ragged_plan.ragged_verify_plan_reference(verify_lens, prefix_lens, sum(verify_lens) + 2)
    seq_lens = plan.c4_lens
    pages_per_req = max(-(-(p + n) // 4 // CPAGE) for p, n in zip(prefix_lens, verify_lens)) + 1
    perm = torch.randperm(num_pages, generator=gen)
    req_pages = perm[: len(verify_lens) * pages_per_req].view(len(verify_lens), pages_per_req)
    page_table = torch.zeros(plan.num_tokens, pages_per_req, dtype=torch.int32)
    real = plan.token_req >= 0
    page_table[real] = req_pages[plan.token_req[real].long()].to(torch.int32)
    cache = kv_layout.new_index_cache(num_pages)
    slots = torch.arange(num_pages * CPAGE)
    codes = torch.randint(0, 0x7F, (slots.numel(), 128), generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8) << 7
    scales = torch.rand(slots.numel(), generator=gen) * 0.01 + 1e-3
    kv_layout.write_index_rows(cache, slots, codes, scales)
    q = torch.randint(0, 0x7F, (plan.num_tokens, HEADS, 128), generator=gen, dtype=torch.uint8)
    q |= torch.randint(0, 2, q.shape, generator=gen, dtype=torch.uint8) << 7
    weights = torch.randn(plan.num_tokens, HEADS, generator=gen) * 1e-3
    return q.view(torch.float8_e4m3fn), weights, cache, seq_lens, page_table


def assert_same_selection(got, got_raw, want, q, weights, cache, seq_lens, page_table, topk):
    logits = index_topk.index_logits_reference(q, weights, cache, seq_lens, page_table)
    for r in range(q.shape[0]):
        n = int(seq_lens[r])
        if n <= topk:  # taken whole, in order
            assert torch.equal(got[r], want[r]), r
            continue
        raw = got_raw[r].long()
        assert raw.unique().numel() == topk and int(raw.min()) >= 0 and int(raw.max()) < n, r
        slots = page_table[r].long()[raw // CPAGE] * CPAGE + raw % CPAGE
        assert torch.equal(got[r].long(), slots), r
        picked = logits[r, raw].sort(descending=True).values
        best = logits[r, :n].topk(topk).values
        torch.testing.assert_close(picked, best, rtol=1e-5, atol=1e-6 * float(best.abs().max()))


def run(q, weights, cache, seq_lens, page_table, topk):
    dev = lambda t: t.to(DEVICE)
    got, raw = index_topk.index_topk(
        dev(q), dev(weights), dev(cache), dev(seq_lens), dev(page_table), topk
    )
    return got.cpu(), raw.cpu()


@direct
def test_small_topk_on_ragged_verify():
    # rows: no history (positions 0..2), shorter than top-k, longer with page crossings
    verify_lens, prefix_lens = [3, 6, 1, 5, 2, 4], [0, 250, 300, 509, 61, 1100]
    batch = indexer_batch(verify_lens, prefix_lens, num_pages=40)
    got, raw = run(*batch, topk=64)
    want, _ = index_topk.index_topk_reference(*batch, topk=64)
    assert (batch[3] == 0).any() and (batch[3] > 64).any() and (batch[3] <= 64).any()
    assert (got[batch[3] == 0] == -1).all()
    assert_same_selection(got, raw, want, *batch, topk=64)


@direct
@pytest.mark.slow
def test_v4_topk_512():
    verify_lens, prefix_lens = [6, 1, 4], [2300, 2047, 1900]  # compressed lengths 475 .. 576
    batch = indexer_batch(verify_lens, prefix_lens, num_pages=36, seed=1)
    got, raw = run(*batch, topk=512)
    want, _ = index_topk.index_topk_reference(*batch, topk=512)
    assert_same_selection(got, raw, want, *batch, topk=512)


@needs_gpu
def test_matches_deepgemm_logits_and_sglang_topk():
    import deep_gemm
    from sglang.kernels.ops.attention.dsv4 import (
        get_paged_mqa_logits_metadata,
        topk_transform_paged,
    )

    verify_lens, prefix_lens = [6, 1, 4, 3, 2, 5] * 4, [2300, 2047, 1900, 0, 700, 9000] * 4
    q, weights, cache, seq_lens, page_table = [
        t.cuda() for t in indexer_batch(verify_lens, prefix_lens, num_pages=1000, seed=2)
    ]
    ours, ours_raw = index_topk.index_topk(q, weights, cache, seq_lens, page_table, 512)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    metadata = get_paged_mqa_logits_metadata(seq_lens, CPAGE, num_sms)
    max_len = int(seq_lens.max())
    logits = deep_gemm.fp8_paged_mqa_logits(
        q.unsqueeze(1), cache.view(cache.shape[0], CPAGE, 1, 132), weights,
        seq_lens.unsqueeze(-1), page_table, metadata, max_len, False,
    )  # fmt: skip
    theirs = torch.empty_like(ours)
    topk_transform_paged(logits, seq_lens, page_table, theirs, CPAGE)
    cpu = lambda *ts: [t.cpu() for t in ts]
    q, weights, cache, seq_lens, page_table = cpu(q, weights, cache, seq_lens, page_table)
    assert_same_selection(
        *cpu(ours, ours_raw), theirs.cpu(), q, weights, cache, seq_lens, page_table, 512
    )
    # and SGLang's own selection is as good as ours on the reference logits
    ref = index_topk.index_logits_reference(q, weights, cache, seq_lens, page_table)
    for r in range(q.shape[0]):
        if int(seq_lens[r]) > 512:
            mine = ref[r, ours_raw[r].long().cpu()].sum()
            pos = theirs[r].cpu().long()
            page_of = {int(p): i for i, p in enumerate(page_table[r].tolist())}
            raw = torch.tensor([page_of[int(s) // CPAGE] * CPAGE + int(s) % CPAGE for s in pos])
            torch.testing.assert_close(ref[r, raw].sum(), mine, rtol=1e-4, atol=1e-4)

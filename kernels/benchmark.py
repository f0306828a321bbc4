"""Time the Triton kernels against SGLang's CUDA kernels, side by side in one run (GPU only).

    python kernels/benchmark.py [--requests 64] [--context 8192] [--topk 512]

A verify batch of `--requests` requests with verify lengths drawn from 1 .. 6 (gamma 5), each
with about `--context` committed tokens. Prints, per kernel, SGLang's time, ours, and
ours / SGLang (below 1: ours is faster). Times are medians of `triton.testing.do_bench`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    sys.exit(
        "kernels/benchmark.py times the kernels against SGLang's CUDA kernels and needs a CUDA "
        "GPU; none is visible here. On CPU run the tests instead: "
        "pytest tests/test_kernels_*.py"
    )

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_kernels import (
    compressor,
    index_topk,
    indexer_query,
    kv_layout,
    kv_store,
    ragged_plan,
)

PAGE = 256


def freqs_cis(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    inv = theta ** (-torch.arange(0, 32, dtype=torch.float64) / 32)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).cuda()


class Batch:
    def __init__(self, requests: int, context: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.verify_lens = torch.randint(1, 7, (requests,), generator=gen).tolist()
        self.prefix_lens = (context + torch.randint(0, PAGE, (requests,), generator=gen)).tolist()
        self.tokens = sum(self.verify_lens)
        self.pages_per_req = -(-(max(self.prefix_lens) + 8) // PAGE)
        self.num_pages = requests * self.pages_per_req + 1
        perm = torch.randperm(self.num_pages, generator=gen)[: requests * self.pages_per_req]
        self.req_pages = perm.view(requests, self.pages_per_req)
        max_tokens = self.pages_per_req * PAGE
        p = torch.arange(max_tokens)
        self.req_to_token = (self.req_pages[:, p // PAGE] * PAGE + p % PAGE).to(torch.int32)
        raw = [
            self.req_to_token[b, prefix : prefix + n]
            for b, (n, prefix) in enumerate(zip(self.verify_lens, self.prefix_lens))
        ]
        self.raw_out_loc = torch.cat(raw).long().cuda()
        self.plan = ragged_plan.ragged_verify_plan(
            torch.tensor(self.verify_lens).cuda(), torch.tensor(self.prefix_lens).cuda(),
            self.tokens, self.raw_out_loc,
        )  # fmt: skip
        self.page_table = self.req_pages[self.plan.token_req.long().cpu()].to(torch.int32).cuda()
        self.freqs = freqs_cis(max_tokens + 8)


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def report(name: str, theirs, ours) -> None:
    t_theirs, t_ours = bench(theirs), bench(ours)
    print(f"{name:<44} {t_theirs * 1e3:>10.1f} {t_ours * 1e3:>10.1f} {t_ours / t_theirs:>8.2f}")


def kv_store_case(batch: Batch) -> None:
    from sglang.kernels.ops.attention.dsv4 import fused_k_norm_rope_flashmla

    kv = torch.randn(batch.tokens, 512, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(512, device="cuda", dtype=torch.bfloat16)
    pos = batch.plan.token_pos
    loc = batch.raw_out_loc.to(torch.int32)
    cache = kv_layout.new_v4_cache(batch.num_pages, PAGE, device="cuda")
    report(
        "(d) KV norm+rope+fp8 store",
        lambda: fused_k_norm_rope_flashmla(kv, weight, 1e-6, batch.freqs, pos, loc, cache, PAGE),
        lambda: kv_store.kv_norm_rope_store(kv, weight, 1e-6, batch.freqs, pos, loc, cache, PAGE),
    )


def indexer_query_case(batch: Batch) -> None:
    from sglang.kernels.ops.attention.dsv4 import fused_q_indexer_rope_hadamard_quant

    q = torch.randn(batch.tokens, 64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(batch.tokens, 64, device="cuda", dtype=torch.bfloat16)
    pos = batch.plan.token_pos
    scale = 128**-0.5 * 64**-0.5
    report(
        "(b) indexer q rope+hadamard+fp8",
        lambda: fused_q_indexer_rope_hadamard_quant(q, w, scale, batch.freqs, pos),
        lambda: indexer_query.indexer_query(q, w, scale, batch.freqs, pos),
    )


def index_topk_case(batch: Batch, topk: int) -> None:
    import deep_gemm
    from sglang.kernels.ops.attention.dsv4 import (
        get_paged_mqa_logits_metadata,
        topk_transform_paged,
    )

    cpage = PAGE // 4
    cache = torch.randint(0, 0x7E, (batch.num_pages, cpage * 132), dtype=torch.uint8, device="cuda")
    scales = cache.view(torch.float32)[:, cpage * 32 :]
    scales.copy_(torch.rand_like(scales) * 0.01)
    q = torch.randint(0, 0x7E, (batch.tokens, 64, 128), dtype=torch.uint8, device="cuda")
    q = q.view(torch.float8_e4m3fn)
    weights = torch.randn(batch.tokens, 64, device="cuda")
    seq = batch.plan.c4_lens
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    metadata = get_paged_mqa_logits_metadata(seq, cpage, num_sms)
    max_len = int(seq.max())
    out = torch.empty(batch.tokens, topk, dtype=torch.int32, device="cuda")
    cache4 = cache.view(batch.num_pages, cpage, 1, 132)

    def theirs():
        logits = deep_gemm.fp8_paged_mqa_logits(
            q.unsqueeze(1), cache4, weights, seq.unsqueeze(-1), batch.page_table, metadata,
            max_len, False,
        )  # fmt: skip
        topk_transform_paged(logits, seq, batch.page_table, out, cpage)

    report(
        f"(c) index logits + top-{topk}",
        theirs,
        lambda: index_topk.index_topk(q, weights, cache, seq, batch.page_table, topk),
    )


def compressor_case(batch: Batch, ratio: int, head_dim: int) -> None:
    from sglang.kernels.ops.attention.dsv4 import (
        CompressorPrefillPlan,
        compress_forward,
        compress_norm_rope_store,
    )

    ring = 16 if ratio == 4 else 256
    reqs = len(batch.verify_lens)
    rid = torch.arange(reqs, dtype=torch.int64, device="cuda")
    addr = ragged_plan.StateAddressing(
        req_pool_indices=rid,
        req_to_token=batch.req_to_token.cuda(),
        full_to_swa=torch.arange(batch.num_pages * PAGE, dtype=torch.int64, device="cuda"),
        swa_page_size=PAGE,
        ring_size=ring,
    )
    row = (4 if ratio == 4 else 2) * head_dim
    rows = batch.num_pages * ring if ratio == 4 else reqs * ring
    state = torch.randn(rows, row, device="cuda")
    kv_score = torch.randn(batch.tokens, row, device="cuda")
    ape = torch.randn(8 if ratio == 4 else 128, head_dim, device="cuda")
    weight = torch.ones(head_dim, device="cuda")
    out_loc = batch.plan.c4_out_loc if ratio == 4 else batch.plan.c128_out_loc
    if head_dim == 512:
        cache_page = PAGE // ratio
        cache = kv_layout.new_v4_cache(batch.num_pages, cache_page, device="cuda")
    else:
        cache_page = 64
        cache = kv_layout.new_index_cache(batch.num_pages, device="cuda")
    plan = CompressorPrefillPlan.generate(
        compress_ratio=ratio, req_pool_indices=rid,
        seq_lens=torch.tensor([p + n for n, p in zip(batch.verify_lens, batch.prefix_lens)]),
        extend_lens=torch.tensor(batch.verify_lens), req_to_token=addr.req_to_token,
        full_to_state=addr.full_to_swa, swa_page_size=PAGE, ring_size=ring,
        num_q_tokens=batch.tokens,
    )  # fmt: skip

    def theirs():
        compact = compress_forward(
            state.view(-1, ratio, row), kv_score, ape, plan, head_dim=head_dim,
            compress_ratio=ratio,
        )  # fmt: skip
        compress_norm_rope_store(
            compact, plan, norm_weight=weight, norm_eps=1e-6, freq_cis=batch.freqs,
            out_loc=out_loc, kvcache=cache, page_size=cache_page,
        )  # fmt: skip

    def ours():
        compressor.compress_verify(
            kv_score, state, ape, batch.plan, addr, ratio, weight, 1e-6, batch.freqs, out_loc,
            cache, cache_page,
        )  # fmt: skip

    name = f"(a) C{ratio} compressor, D={head_dim} (no plan)"
    report(name, theirs, ours)


def plan_case(batch: Batch) -> None:
    from sglang.kernels.ops.attention.dsv4 import CompressorPrefillPlan

    rid = torch.arange(len(batch.verify_lens), dtype=torch.int64, device="cuda")
    seq = torch.tensor([p + n for n, p in zip(batch.verify_lens, batch.prefix_lens)]).cuda()
    ext = torch.tensor(batch.verify_lens).cuda()
    r2t = batch.req_to_token.cuda()
    f2s = torch.arange(batch.num_pages * PAGE, dtype=torch.int64, device="cuda")
    prefix = torch.tensor(batch.prefix_lens).cuda()

    def theirs():
        CompressorPrefillPlan.generate(
            compress_ratio=4, req_pool_indices=rid, seq_lens=seq, extend_lens=ext,
            req_to_token=r2t, full_to_state=f2s, swa_page_size=PAGE, ring_size=16,
            num_q_tokens=batch.tokens, use_cuda_graph=True,
        )  # fmt: skip

    report(
        "(a) plan from verify_lens (device inputs)",
        theirs,
        lambda: ragged_plan.ragged_verify_plan(ext, prefix, batch.tokens, batch.raw_out_loc),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=512)
    args = parser.parse_args()
    batch = Batch(args.requests, args.context)
    print(
        f"{args.requests} requests, {batch.tokens} verify tokens, ~{args.context} context, "
        f"{torch.cuda.get_device_name()}"
    )
    print(f"{'kernel':<44} {'SGLang us':>10} {'ours us':>10} {'ratio':>8}")
    kv_store_case(batch)
    indexer_query_case(batch)
    index_topk_case(batch, args.topk)
    compressor_case(batch, 4, 512)
    compressor_case(batch, 4, 128)
    compressor_case(batch, 128, 512)
    plan_case(batch)


if __name__ == "__main__":
    main()

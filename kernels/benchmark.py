"""Time the Triton kernels against their torch references, the device's memory bandwidth and,
where SGLang is importable, SGLang's CUDA kernels: one table, one run.

    python kernels/benchmark.py [--requests 64] [--context 8192] [--topk 512] [--peak-gbs GBS]

A verify batch of `--requests` requests with verify lengths drawn from 1 .. 6 (gamma 5), each
with about `--context` committed tokens. Per kernel: the bytes it must move at least (inputs
read once, outputs written once), our time and the bandwidth that gives, as a share of the
device's peak (the roofline of a memory-bound kernel; `--peak-gbs`, else the datasheet value
for known GPUs, else the measured device-to-device copy bandwidth), the torch reference's
time, and SGLang's when `sglang` imports (the device machine has none: those columns read -).
Times are medians of `triton.testing.do_bench`.

Without a GPU it runs the same table through Triton's interpreter at a toy size (`--requests
4 --context 512`): that checks the script and the kernels' calls, its times measure nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
if not GPU:  # the interpreter must be on before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

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

# Datasheet HBM bandwidth, GB/s (name substring -> peak).
PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0,
            "H100": 3350.0, "H20": 4000.0, "B200": 8000.0, "A100-SXM4-80GB": 2039.0,
            "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0}  # fmt: skip
PAGE = 256


def freqs_cis(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    inv = theta ** (-torch.arange(0, 32, dtype=torch.float64) / 32)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(DEV)


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
        self.raw_out_loc = torch.cat(raw).long().to(DEV)
        self.plan = ragged_plan.ragged_verify_plan(
            torch.tensor(self.verify_lens).to(DEV), torch.tensor(self.prefix_lens).to(DEV),
            self.tokens, self.raw_out_loc,
        )  # fmt: skip
        self.page_table = self.req_pages[self.plan.token_req.long().cpu()].to(torch.int32).to(DEV)
        self.freqs = freqs_cis(max_tokens + 8)


def bench(fn) -> float:
    """Median milliseconds of ``fn``."""
    if GPU:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB (read + write), GB/s: the attainable bandwidth."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


ROWS: list[dict] = []


def report(name: str, nbytes: int, ours, reference, theirs=None) -> None:
    """One table row; ``theirs`` (SGLang's kernel) may be None (not importable here)."""
    t_ours, t_ref = bench(ours), bench(reference)
    t_theirs = bench(theirs) if theirs is not None else None
    ROWS.append({"kernel": name, "bytes": nbytes, "ours_ms": t_ours, "reference_ms": t_ref,
                 "sglang_ms": t_theirs})  # fmt: skip


def print_table(peak: float, peak_src: str) -> None:
    print(f"peak bandwidth {peak:.0f} GB/s ({peak_src})")
    print(f"{'kernel':<40} {'MB':>7} {'ours us':>9} {'GB/s':>7} {'% peak':>7} {'torch us':>10} "
          f"{'ours/torch':>10} {'SGLang us':>10} {'ours/SGLang':>11}")  # fmt: skip
    for r in ROWS:
        gbs = r["bytes"] / (r["ours_ms"] * 1e-3) / 1e9
        theirs = r["sglang_ms"]
        t_col = (
            f"{theirs * 1e3:>10.1f} {r['ours_ms'] / theirs:>11.2f}"
            if theirs
            else f"{'-':>10} {'-':>11}"
        )
        bw = f"{gbs:>7.0f} {100 * gbs / peak:>6.0f}%" if GPU else f"{'-':>7} {'-':>7}"
        print(f"{r['kernel']:<40} {r['bytes'] / 1e6:>7.2f} {r['ours_ms'] * 1e3:>9.1f} {bw} "
              f"{r['reference_ms'] * 1e3:>10.1f} "
              f"{r['ours_ms'] / r['reference_ms']:>10.3f} {t_col}")  # fmt: skip


def sglang_kernel(name: str):
    """SGLang's V4 kernel ``name`` when SGLang and a GPU are here, else None."""
    if not GPU:
        return None
    try:
        from sglang.kernels.ops.attention import dsv4
    except Exception:  # noqa: BLE001 - no SGLang (or no CUDA build of it): our columns only
        return None
    return getattr(dsv4, name, None)


def kv_store_case(batch: Batch) -> None:
    kv = torch.randn(batch.tokens, 512, device=DEV, dtype=torch.bfloat16)
    weight = torch.ones(512, device=DEV, dtype=torch.bfloat16)
    pos = batch.plan.token_pos
    loc = batch.raw_out_loc.to(torch.int32)
    cache = kv_layout.new_v4_cache(batch.num_pages, PAGE, device=DEV)
    # kv row (bf16) + its rotation row (32 complex64) in, the 584-byte V4 row out
    nbytes = batch.tokens * (512 * 2 + 32 * 8 + 584)
    fused = sglang_kernel("fused_k_norm_rope_flashmla")
    report(
        "(d) KV norm+rope+fp8 store", nbytes,
        lambda: kv_store.kv_norm_rope_store(kv, weight, 1e-6, batch.freqs, pos, loc, cache, PAGE),
        lambda: kv_store.kv_norm_rope_store_reference(kv, weight, 1e-6, batch.freqs, pos, loc,
                                                      cache, PAGE),
        fused and (lambda: fused(kv, weight, 1e-6, batch.freqs, pos, loc, cache, PAGE)),
    )  # fmt: skip


def indexer_query_case(batch: Batch) -> None:
    q = torch.randn(batch.tokens, 64, 128, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(batch.tokens, 64, device=DEV, dtype=torch.bfloat16)
    pos = batch.plan.token_pos
    scale = 128**-0.5 * 64**-0.5
    # q (bf16) + weights (bf16) + rotation row in; e4m3 q, float32 scales and weights out
    nbytes = batch.tokens * (64 * 128 * 2 + 64 * 2 + 32 * 8 + 64 * 128 + 64 * 4 + 64 * 4)
    fused = sglang_kernel("fused_q_indexer_rope_hadamard_quant")
    report(
        "(b) indexer q rope+hadamard+fp8", nbytes,
        lambda: indexer_query.indexer_query(q, w, scale, batch.freqs, pos),
        lambda: indexer_query.indexer_query_reference(q, w, scale, batch.freqs, pos),
        fused and (lambda: fused(q, w, scale, batch.freqs, pos)),
    )  # fmt: skip


def index_topk_case(batch: Batch, topk: int) -> None:
    cpage = PAGE // 4
    cache = torch.randint(0, 0x7E, (batch.num_pages, cpage * 132), dtype=torch.uint8, device=DEV)
    scales = cache.view(torch.float32)[:, cpage * 32 :]
    scales.copy_(torch.rand_like(scales) * 0.01)
    q = torch.randint(0, 0x7E, (batch.tokens, 64, 128), dtype=torch.uint8, device=DEV)
    q = q.view(torch.float8_e4m3fn)
    weights = torch.randn(batch.tokens, 64, device=DEV)
    seq = batch.plan.c4_lens
    out = torch.empty(batch.tokens, topk, dtype=torch.int32, device=DEV)
    # each request's compressed keys once (its verify tokens share them), q and weights in,
    # the top-k indices out
    reqs_c4 = sum((p + n) // 4 for n, p in zip(batch.verify_lens, batch.prefix_lens))
    nbytes = reqs_c4 * 132 + batch.tokens * (64 * 128 + 64 * 4 + topk * 4)
    theirs = None
    transform, meta = (
        sglang_kernel("topk_transform_paged"),
        sglang_kernel("get_paged_mqa_logits_metadata"),
    )
    if transform is not None and meta is not None:
        import deep_gemm

        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        metadata = meta(seq, cpage, num_sms)
        max_len = int(seq.max())
        cache4 = cache.view(batch.num_pages, cpage, 1, 132)

        def theirs():
            logits = deep_gemm.fp8_paged_mqa_logits(
                q.unsqueeze(1), cache4, weights, seq.unsqueeze(-1), batch.page_table, metadata,
                max_len, False,
            )  # fmt: skip
            transform(logits, seq, batch.page_table, out, cpage)

    report(
        f"(c) index logits + top-{topk}", nbytes,
        lambda: index_topk.index_topk(q, weights, cache, seq, batch.page_table, topk),
        lambda: index_topk.index_topk_reference(q, weights, cache, seq, batch.page_table, topk),
        theirs,
    )  # fmt: skip


def compressor_case(batch: Batch, ratio: int, head_dim: int) -> None:
    ring = 16 if ratio == 4 else 256
    reqs = len(batch.verify_lens)
    rid = torch.arange(reqs, dtype=torch.int64, device=DEV)
    addr = ragged_plan.StateAddressing(
        req_pool_indices=rid,
        req_to_token=batch.req_to_token.to(DEV),
        full_to_swa=torch.arange(batch.num_pages * PAGE, dtype=torch.int64, device=DEV),
        swa_page_size=PAGE,
        ring_size=ring,
    )
    row = (4 if ratio == 4 else 2) * head_dim
    rows = batch.num_pages * ring if ratio == 4 else reqs * ring
    state = torch.randn(rows, row, device=DEV)
    kv_score = torch.randn(batch.tokens, row, device=DEV)
    ape = torch.randn(8 if ratio == 4 else 128, head_dim, device=DEV)
    weight = torch.ones(head_dim, device=DEV)
    out_loc = batch.plan.c4_out_loc if ratio == 4 else batch.plan.c128_out_loc
    if head_dim == 512:
        cache_page, out_row = PAGE // ratio, 584
        cache = kv_layout.new_v4_cache(batch.num_pages, cache_page, device=DEV)
    else:
        cache_page, out_row = 64, 132
        cache = kv_layout.new_index_cache(batch.num_pages, device=DEV)
    # verify rows read once; per compressed row, the window's rows that precede the verify
    # block read from the state ring; the compressed row stored; every verify row written to
    # the ring (the write pad keeps them all)
    window = 8 if ratio == 4 else 128
    closing = [(p + i + 1) % ratio == 0 for n, p in zip(batch.verify_lens, batch.prefix_lens)
               for i in range(n)]  # fmt: skip
    from_state = 0
    for n, p in zip(batch.verify_lens, batch.prefix_lens):
        for i in range(n):
            if (p + i + 1) % ratio == 0:
                from_state += max(0, window - (i + 1))
    nbytes = (batch.tokens * row * 4 * 2 + from_state * row * 4 + sum(closing) * out_row
              + window * head_dim * 4)  # fmt: skip
    theirs = None
    cpp, fwd, store = (sglang_kernel(n) for n in ("CompressorPrefillPlan", "compress_forward",
                                                  "compress_norm_rope_store"))  # fmt: skip
    if cpp is not None and fwd is not None and store is not None:
        plan = cpp.generate(
            compress_ratio=ratio, req_pool_indices=rid,
            seq_lens=torch.tensor([p + n for n, p in zip(batch.verify_lens, batch.prefix_lens)]),
            extend_lens=torch.tensor(batch.verify_lens), req_to_token=addr.req_to_token,
            full_to_state=addr.full_to_swa, swa_page_size=PAGE, ring_size=ring,
            num_q_tokens=batch.tokens,
        )  # fmt: skip

        def theirs():
            compact = fwd(state.view(-1, ratio, row), kv_score, ape, plan, head_dim=head_dim,
                          compress_ratio=ratio)  # fmt: skip
            store(compact, plan, norm_weight=weight, norm_eps=1e-6, freq_cis=batch.freqs,
                  out_loc=out_loc, kvcache=cache, page_size=cache_page)  # fmt: skip

    report(
        f"(a) C{ratio} compressor, D={head_dim} (no plan)", nbytes,
        lambda: compressor.compress_verify(kv_score, state, ape, batch.plan, addr, ratio, weight,
                                           1e-6, batch.freqs, out_loc, cache, cache_page),
        lambda: compressor.compress_verify_reference(
            kv_score, state, ape, batch.verify_lens, batch.prefix_lens, addr, ratio, weight,
            1e-6, batch.freqs, out_loc, cache, cache_page),
        theirs,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64 if GPU else 4)
    parser.add_argument("--context", type=int, default=8192 if GPU else 512)
    parser.add_argument("--topk", type=int, default=512 if GPU else 64)
    parser.add_argument(
        "--peak-gbs",
        type=float,
        default=None,
        help="the device's peak memory bandwidth (default: datasheet / measured)",
    )
    args = parser.parse_args(argv)
    batch = Batch(args.requests, args.context)
    name = (
        torch.cuda.get_device_name() if GPU else "CPU, Triton interpreter (times measure nothing)"
    )
    print(
        f"{args.requests} requests, {batch.tokens} verify tokens, ~{args.context} context, {name}"
    )
    measured = copy_bandwidth_gbs() if GPU else None
    if args.peak_gbs:
        peak, src = args.peak_gbs, "--peak-gbs"
    elif GPU and any(k in name for k in PEAK_GBS):
        key = next(k for k in PEAK_GBS if k in name)
        peak, src = PEAK_GBS[key], f"{key} datasheet; measured copy {measured:.0f} GB/s"
    elif GPU:
        peak, src = measured, "measured device-to-device copy"
    else:
        peak, src = 1.0, "none: interpreter"
    kv_store_case(batch)
    indexer_query_case(batch)
    index_topk_case(batch, args.topk)
    compressor_case(batch, 4, 512)
    compressor_case(batch, 4, 128)
    compressor_case(batch, 128, 512)
    print_table(peak, src)


if __name__ == "__main__":
    main()

"""Let SGLang's EAGLE worker serve an MTP-1 baseline on a CPU device.

MTP-1 (DeepSeek's one-token multi-token-prediction drafter) is served by SGLang's EAGLE worker
as `--speculative-algorithm EAGLE3|EAGLE|NEXTN --speculative-num-steps 1
--speculative-eagle-topk 1 --speculative-num-draft-tokens 2`. Upstream 0.5.23 cannot run that
on `--device cpu --attention-backend torch_native`; each function below closes one gap and is
a named hook:

- `eagle_cpu_chain_only`: our CPU verify attention (`torch_native_target_verify`) is causal
  over a chain and ignores EAGLE's tree mask, and `torch_native` has no multi-step draft
  backend: anything but one step of top-1 drafting is refused at start-up with the fix.
- `eagle_torch_native_draft_extend`: the draft-extend backend factory has no `torch_native`
  entry ("EAGLE is not supported in attention backend torch_native").
- `cpu_eagle_tree_ops`: `build_tree_kernel_efficient` and `verify_tree_greedy` reach
  sgl-kernel CPU ops that the CUDA-only wheel lacks (patch 0001 placeholders). Ported to
  Python from SGLang's Triton kernels (`spec_tree.py`), any topk.
- `cpu_eagle_sampling_verify`: `_verify_uses_greedy` is True whenever the device is the CPU, so
  a temperature-1 request silently gets the target's argmax: not lossless. We take the sampling
  path, with target-only rejection sampling (our chain sampler with one-hot draft
  probabilities: accept x with probability p(x), else resample from p without x; lossless for
  any proposal) and top-k / top-p renormalisation in torch. With
  `--speculative-use-rejection-sampling` (the embedded MTP-1 arm's setting) the draft is
  sampled from q and verified against it by our chain sampler: E[accept] = 1 - TV(p, q)
  instead of p(argmax q). Same 30 prompts at T=1: accept length 1.22 -> 1.35.
- `cpu_row_argmax`: draft proposals (Gumbel-max `fast_sample`) call the Triton-only
  `row_argmax`; on CPU tensors it is `argmax(-1)`.
"""

from __future__ import annotations

import torch

from sglang_dspark.plugin.registry import applied_check, register_around, register_replace

# ----------------------------------------------------------------- eagle_cpu_chain_only


def _handle_eagle_family_on_cpu(original, server_args):
    original(server_args)
    from sglang.srt.arg_groups.speculative_hook import resolved_view

    view = resolved_view(server_args)
    if not str(view.device).startswith("cpu"):
        return
    topk, steps = view.speculative_eagle_topk, view.speculative_num_steps
    if topk != 1 or steps != 1:
        raise ValueError(
            f"--speculative-algorithm {view.speculative_algorithm} on --device cpu serves one "
            f"draft token per round (MTP-1); got --speculative-eagle-topk {topk} "
            f"--speculative-num-steps {steps}. The CPU verify attention is a causal chain "
            "(no tree mask) and torch_native has no multi-step draft backend. Use "
            "--speculative-num-steps 1 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 2, or --speculative-algorithm DSPARK for longer "
            "drafts."
        )


def install_chain_only() -> None:
    register_around(
        "sglang.srt.arg_groups.speculative_hook._handle_eagle_family",
        _handle_eagle_family_on_cpu,
    )


# ------------------------------------------------------- eagle_torch_native_draft_extend

_DRAFT_EXTEND_ERROR = "EAGLE is not supported in attention backend {backend_type}"


def _create_backend_with_torch_native(
    original, self, backend_name, backend_map, error_template, stamps_children=False
):
    if error_template == _DRAFT_EXTEND_ERROR and "torch_native" not in backend_map:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        runner = self.draft_model_runner
        backend_map = {
            **backend_map,
            "torch_native": lambda: ("torch_native", TorchNativeAttnBackend(runner)),
        }
    return original(self, backend_name, backend_map, error_template, stamps_children)


def install_torch_native_draft_extend() -> None:
    register_around(
        "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend",
        _create_backend_with_torch_native,
    )


# -------------------------------------------------------------------- cpu_eagle_tree_ops


def _slot_of(selected: list[int], token_idx: int, n: int) -> int | None:
    """The first draft slot pp < n - 1 whose selected index is token_idx."""
    for pp in range(n - 1):
        if selected[pp] == token_idx:
            return pp
    return None


def build_tree_kernel_efficient_cpu(
    parent_list, selected_index, verified_seq_len, tree_mask, positions, retrieve_index,
    retrieve_next_token, retrieve_next_sibling, topk, depth, draft_token_num, tree_mask_mode,
):  # fmt: skip
    """SGLang's `sgl_build_tree_kernel_efficient_triton`, one loop iteration per program.

    For request b with n = draft_token_num tree slots: retrieve_index[b, i] = b * n + i; slot
    i > 0 hangs under the slot holding its parent (selected_index[b, i-1] // topk is its parent
    in parent_list); next-token / next-sibling links; the tree mask row of every slot (its
    ancestors and itself); positions = seq_len + depth of the slot.
    """
    if int(tree_mask_mode) == 2:
        raise NotImplementedError("QLEN_ONLY_BITPACKING tree masks have no CPU implementation")
    n = draft_token_num
    parents = parent_list.reshape(parent_list.shape[0], -1).tolist()
    selected = selected_index.reshape(selected_index.shape[0], -1).tolist()
    seq_lens = verified_seq_len.tolist()
    bs = len(seq_lens)
    prefix = 0
    next_token = [[-1] * n for _ in range(bs)]
    next_sibling = [[-1] * n for _ in range(bs)]
    mask_ones: list[int] = []
    mask_zero_rows: list[tuple[int, int]] = []
    pos_out = [0] * (bs * n)
    for b in range(bs):
        seq_len, sel, par = seq_lens[b], selected[b], parents[b]
        seq_tree_idx = n * n * b + prefix * n

        for i in range(n - 1, 0, -1):
            parent_tb = sel[i - 1] // topk
            if parent_tb == 0:
                parent_pos = 0
            else:
                pp = _slot_of(sel, par[parent_tb], n)
                if pp is None:
                    continue
                parent_pos = pp + 1
            if next_token[b][parent_pos] != -1:
                next_sibling[b][i] = next_token[b][parent_pos]
            next_token[b][parent_pos] = i
        for x in range(n):
            if int(tree_mask_mode) == 0:  # FULL_MASK
                row = seq_tree_idx + (seq_len + n) * x + seq_len + 1
            else:  # QLEN_ONLY
                row = n * n * b + n * x + 1
            mask_ones.append(row - 1)
            mask_zero_rows.append((row, n - 1))
            position = 0
            if x > 0:
                cur = x - 1
                for _ in range(depth):
                    position += 1
                    mask_ones.append(row + cur)
                    parent_tb = sel[cur] // topk
                    if parent_tb == 0:
                        break
                    found = _slot_of(sel, par[parent_tb], n)
                    if found is None:
                        break
                    cur = found
            pos_out[b * n + x] = position + seq_len
        prefix += seq_len
    flat = tree_mask.view(-1)
    for row, width in mask_zero_rows:
        flat[row : row + width] = 0
    if mask_ones:
        flat[torch.tensor(mask_ones, dtype=torch.long)] = 1
    ids = torch.arange(bs * n, dtype=retrieve_index.dtype).view(bs, n)
    retrieve_index[:bs, :n] = ids
    retrieve_next_token[:bs, :n] = torch.tensor(next_token, dtype=retrieve_next_token.dtype)
    retrieve_next_sibling[:bs, :n] = torch.tensor(next_sibling, dtype=retrieve_next_sibling.dtype)
    positions[: bs * n] = torch.tensor(pos_out, dtype=positions.dtype)


def verify_tree_greedy_cpu(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, target_predict,
):  # fmt: skip
    """SGLang's `verify_tree_greedy_kernel_triton`: walk the tree from the root, at each level
    take the first child (in sibling order) whose token equals the target's argmax."""
    bs = candidates.shape[0]
    depth = accept_index.shape[1]
    cand = candidates.tolist()
    ridx = retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    tgt = target_predict.reshape(-1).tolist()
    pred_at: dict[int, int] = {}
    acc_rows, counts = [], []
    for b in range(bs):
        last = ridx[b][0]
        path = [last]
        cur = 0
        for _ in range(1, depth):
            cur = nxt[b][cur]
            want = tgt[last]
            while cur != -1 and cand[b][cur] != want:
                cur = sib[b][cur]
            if cur == -1:
                break
            pred_at[last] = want
            last = ridx[b][cur]
            path.append(last)
        pred_at[last] = tgt[last]
        counts.append(len(path) - 1)
        acc_rows.append(path + [-1] * (depth - len(path)))
    if pred_at:
        slots = torch.tensor(list(pred_at), dtype=torch.long)
        predicts.view(-1)[slots] = torch.tensor(list(pred_at.values()), dtype=predicts.dtype)
    accept_index[:bs] = torch.tensor(acc_rows, dtype=accept_index.dtype)
    accept_token_num[:bs] = torch.tensor(counts, dtype=accept_token_num.dtype)


def install_tree_ops() -> None:
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        return
    module = "sglang.kernels.ops.speculative.spec_tree"
    register_replace(
        f"{module}.sgl_build_tree_kernel_efficient_cpu", build_tree_kernel_efficient_cpu
    )
    register_replace(f"{module}.sgl_verify_tree_greedy_cpu", verify_tree_greedy_cpu)


# ------------------------------------------------------------- cpu_eagle_sampling_verify


def tree_speculative_sampling_target_only_torch(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
    draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True,
):  # fmt: skip
    """Target-only verification of a top-1 chain (SGLang's CUDA kernel of that name, for
    chains): draft x_k is accepted with probability p_t(x_k); at the first rejection the
    replacement comes from p_t with x_k removed, renormalised; after a fully accepted chain the
    bonus comes from p_t. That is chain rejection sampling with a one-hot proposal q, so it
    reuses `chain_speculative_sampling_torch` (lossless for any draft: sum_x q(x) * P(out=y |
    x) = p_t(y))."""
    from sglang_dspark.verification.rejection import chain_speculative_sampling_torch

    drafts = candidates[:, 1:].long()
    one_hot = torch.zeros(
        (*drafts.shape, target_probs.shape[-1]), dtype=target_probs.dtype, device=drafts.device
    )
    one_hot.scatter_(-1, drafts[..., None], 1.0)
    return chain_speculative_sampling_torch(
        predicts, accept_index, accept_token_num, candidates, retrive_index,
        retrive_next_token, retrive_next_sibling, uniform_samples,
        uniform_samples_for_final_sampling, target_probs, one_hot, threshold_single,
        threshold_acc, deterministic,
    )  # fmt: skip


def chain_speculative_sampling_cpu(*args, **kwargs):
    """`--speculative-use-rejection-sampling` on CPU: the draft is sampled from q and verified
    against q (chain rejection sampling, accept x with min(1, p(x)/q(x)), else resample from
    norm(max(p - q, 0))). Upstream's Triton chain kernel, as `chain_speculative_sampling_torch`
    looked up at each call."""
    from sglang_dspark.verification import rejection

    return rejection.chain_speculative_sampling_torch(*args, **kwargs)


def _renorm_from_pivots(probs: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    kept = torch.where(probs >= pivots[:, None], probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def top_k_renorm_prob_torch(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """FlashInfer's top-k renorm (SGLang's `top_k_renorm_probs_triton`): keep the k largest
    probabilities of each row, ties at the pivot included, and renormalise."""
    probs = probs.float()
    k = top_ks.reshape(-1).long().expand(probs.shape[0])
    ordered = probs.sort(dim=-1, descending=True).values
    pivots = ordered.gather(1, (k - 1).clamp(0, probs.shape[-1] - 1)[:, None]).squeeze(1)
    return _renorm_from_pivots(probs, pivots)


def top_p_renorm_prob_torch(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """FlashInfer's top-p renorm (SGLang's `top_p_renorm_probs_triton`): in ascending order,
    drop the prefix whose cumulative mass is below 1 - p (ties at the pivot kept), renormalise."""
    probs = probs.float()
    p = top_ps.reshape(-1).float().expand(probs.shape[0])
    ordered = probs.sort(dim=-1).values
    cutoff = torch.searchsorted(ordered.cumsum(-1), (1.0 - p)[:, None], right=False)
    cutoff = cutoff.clamp(max=probs.shape[-1] - 1)
    return _renorm_from_pivots(probs, ordered.gather(1, cutoff).squeeze(1))


def _sampling_on_cpu(original, *, is_all_greedy, is_cpu, is_hip, is_xpu, use_rejection_sampling):
    return original(
        is_all_greedy=is_all_greedy, is_cpu=False, is_hip=is_hip, is_xpu=is_xpu,
        use_rejection_sampling=use_rejection_sampling,
    )  # fmt: skip


@applied_check("cpu_eagle_sampling_verify")
def _sampling_verify_applied() -> str | None:
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        return None  # the hook changes nothing off CPU
    if eagle_utils.tree_speculative_sampling_target_only is not (
        tree_speculative_sampling_target_only_torch
    ):
        return "eagle_utils.tree_speculative_sampling_target_only is not the torch sampler"
    if eagle_utils.chain_speculative_sampling_triton is not chain_speculative_sampling_cpu:
        return "eagle_utils.chain_speculative_sampling_triton is not the torch chain sampler"
    if eagle_utils.top_k_renorm_prob is None or eagle_utils.top_p_renorm_prob is None:
        return "eagle_utils.top_k_renorm_prob / top_p_renorm_prob are still None"
    return None


def install_sampling_verify() -> None:
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        return
    from sglang.srt.speculative import eagle_utils

    register_around("sglang.srt.speculative.eagle_utils._verify_uses_greedy", _sampling_on_cpu)
    # None-valued upstream names: assigned directly (a HookRegistry REPLACE would rebind every
    # None-valued global of the same name in sys.modules).
    eagle_utils.tree_speculative_sampling_target_only = tree_speculative_sampling_target_only_torch
    eagle_utils.chain_speculative_sampling_triton = chain_speculative_sampling_cpu
    if eagle_utils.top_k_renorm_prob is None:
        eagle_utils.top_k_renorm_prob = top_k_renorm_prob_torch
    if eagle_utils.top_p_renorm_prob is None:
        eagle_utils.top_p_renorm_prob = top_p_renorm_prob_torch


# ------------------------------------------------------------------------ cpu_row_argmax


def _row_argmax_on_cpu(original, x):
    if x.device.type == "cpu":
        return x.argmax(dim=-1)
    return original(x)


def install_row_argmax() -> None:
    register_around("sglang.srt.speculative.spec_utils.row_argmax", _row_argmax_on_cpu)


HOOKS = {
    "eagle_cpu_chain_only": install_chain_only,
    "eagle_torch_native_draft_extend": install_torch_native_draft_extend,
    "cpu_eagle_tree_ops": install_tree_ops,
    "cpu_eagle_sampling_verify": install_sampling_verify,
    "cpu_row_argmax": install_row_argmax,
}

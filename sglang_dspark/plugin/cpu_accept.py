"""`cpu_verified_rows_accept`: the sampled DSPARK accept on CPU reads only the verified rows.

SGLang's accept at temperature > 0 (`dspark_verify.accept_draft_tokens`) softmaxes all
bs x gamma draft rows and all bs x (gamma + 1) target rows, runs the chain sampler over the
whole block and then caps each request's accepted length at its verify window. Under
confidence scheduling a request verifies about 3 of its 8 slots at 4 users, T=1, so most of
those full-vocabulary passes (about 7 of the 9 ms of a CPU accept, docs/results.md) are
thrown away.

On CPU tensors, when the batch samples with temperatures only (no top-k / top-p, no block
verification, no counter-based rejection noise), `sglang_dspark.verification.rejection.chain_accept_verified`
takes over: it softmaxes the rows that check a draft inside the window, then one target row
(and one draft row after a rejection) per request. The coins are drawn as SGLang draws them
(`torch.rand` of [bs, gamma], then [bs]); greedy requests of a mixed batch keep SGLang's argmax
accept and its selection. Lossless (tests/test_verified_accept.py): a request whose window
covers the block gets SGLang's tokens on the same coins; one with a shorter window takes its
next token from the target at the window's end, which is the distribution SGLang's cap also
draws from. The draft after a window is never read, which is what lets the draft pass stop
early (`cpu_draft_until_verifiable`). `cap_trim_lens` is 0: how far a block would have been
accepted past its window is not computed (SGLang's block-accept metric then equals the
committed length).
"""

from __future__ import annotations

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.srt.speculative.dspark_components.dspark_verify.accept_draft_tokens"

_state = {"installed": False}


def installed() -> bool:
    """Whether this hook is in place (the early-stopping draft pass needs it for T > 0)."""
    return _state["installed"]


def applies(sampling_info, device, *, block_verification=False, rejection_noise=None) -> bool:
    """Whether a batch's sampled accept runs here (else SGLang's own accept runs)."""
    return (
        installed()
        and device.type == "cpu"
        and sampling_info is not None
        and not sampling_info.is_all_greedy
        and not sampling_info.need_top_k_sampling
        and not sampling_info.need_top_p_sampling
        and not block_verification
        and rejection_noise is None
    )


def _accept(
    original,
    *,
    candidates,
    target_logits,
    draft_block,
    sampling_info,
    draft_input,
    gamma,
    verify_num_draft_tokens,
    cutoff_layout=None,
    fused_argmax=False,
    block_verification=False,
    rejection_noise=None,
):
    kwargs = {
        "candidates": candidates,
        "target_logits": target_logits,
        "draft_block": draft_block,
        "sampling_info": sampling_info,
        "draft_input": draft_input,
        "gamma": gamma,
        "verify_num_draft_tokens": verify_num_draft_tokens,
        "cutoff_layout": cutoff_layout,
        "fused_argmax": fused_argmax,
        "block_verification": block_verification,
        "rejection_noise": rejection_noise,
    }
    if not applies(
        sampling_info,
        candidates.device,
        block_verification=block_verification,
        rejection_noise=rejection_noise,
    ):
        return original(**kwargs)
    import torch
    from sglang.kernels.ops.speculative.dspark.dspark_accept import SelectMixedAccept

    from sglang_dspark.verification import rejection

    bs = candidates.shape[0]
    device = candidates.device
    verify_lens = (
        torch.full((bs,), verify_num_draft_tokens, dtype=torch.int64, device=device)
        if cutoff_layout is None
        else cutoff_layout.verify_lens
    )
    # SGLang's coins, drawn in SGLang's order (`_accept_sampling_core`)
    coins = torch.rand((bs, gamma), dtype=torch.float32, device=device)
    final_coins = torch.rand((bs,), dtype=torch.float32, device=device)
    n, token = rejection.chain_accept_verified(  # looked up now: the test controls wrap it
        candidates[:, 1 : gamma + 1],
        target_logits.view(bs, verify_num_draft_tokens, -1),
        None if draft_block.greedy_draft else draft_block.corrected_logits,
        sampling_info.temperatures.view(-1)[:bs].to(torch.float32),
        draft_block.temperatures.view(-1)[:bs],
        verify_lens,
        coins,
        final_coins,
        # a reduced draft vocabulary (`cpu_draft_until_verifiable`) rides on its logits
        draft_vocab=getattr(draft_block.corrected_logits, "dspark_draft_vocab", None),
    )
    correct_len = n.to(torch.int32)
    bonus = token.to(torch.int64)
    trim = torch.zeros_like(correct_len)
    if not sampling_info.is_any_greedy:
        return correct_len, bonus, trim
    greedy_len, greedy_bonus, greedy_trim = original(**{**kwargs, "sampling_info": None})
    selected = SelectMixedAccept.execute(
        greedy_mask=draft_block.greedy_mask,
        greedy_len=greedy_len,
        greedy_bonus=greedy_bonus,
        greedy_trim=greedy_trim,
        sampling_len=correct_len,
        sampling_bonus=bonus,
        sampling_trim=trim,
    )
    return selected.correct_len, selected.bonus, selected.cap_trim_lens


def install() -> None:
    register_around(TARGET, _accept)
    _state["installed"] = True


HOOKS = {"cpu_verified_rows_accept": install}

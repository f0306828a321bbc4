"""Drafter model: attention structure, Markov head locality, target adapter, SGLang parity."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_dspark.drafter.config import DSparkDraftConfig
from sglang_dspark.drafter.formats.checkpoint import save_draft, sglang_load_check
from sglang_dspark.drafter.markov_head import sample_block
from sglang_dspark.drafter.model import (
    BlockLayout,
    DSparkDrafter,
    init_weights,
    single_sequence_layout,
)
from sglang_dspark.drafter.training.target import (
    TargetAdapter,
    make_tiny_target,
    sglang_capture_points,
)

torch.set_num_threads(1)

V, H, GAMMA = 96, 32, 4


def tiny_config(head_type: str = "vanilla", **kw) -> DSparkDraftConfig:
    base = {
        "hidden_size": H,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": V,
        "target_layer_ids": [0, 2],
        "num_target_layers": 4,
        "block_size": GAMMA,
        "markov_rank": 8,
        "markov_head_type": head_type,
        "mask_token_id": V - 1,
        "rope_theta": 50000.0,  # not the default: the parity test must see it reach SGLang
        "max_position_embeddings": 512,
    }
    base.update(kw)
    return DSparkDraftConfig(**base)


def tiny_drafter(head_type: str = "vanilla", seed: int = 0, **kw) -> DSparkDrafter:
    d = DSparkDrafter(tiny_config(head_type, **kw))
    init_weights(d, seed=seed, std=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    d.attach_shared(torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen))
    return d.eval()


def packed_two_sequences(d: DSparkDrafter, gen: torch.Generator):
    """Two sequences packed into one call: 3 blocks in seq A (len 20), 2 in seq B (len 14)."""
    S_a, S_b = 20, 14
    ids = torch.randint(0, V - 1, (S_a + S_b,), generator=gen)
    feats = torch.randn(S_a + S_b, 2 * H, generator=gen)
    anchors = torch.tensor([3, 9, 15, 5, 11])
    offsets = torch.tensor([0, 0, 0, S_a, S_a])
    block_ids = torch.full((5, GAMMA), d.config.mask_token_id)
    block_ids[:, 0] = ids[offsets + anchors]
    layout = BlockLayout(
        block_ids=block_ids,
        positions=anchors[:, None] + torch.arange(GAMMA),
        ctx_positions=torch.cat([torch.arange(S_a), torch.arange(S_b)]),
        ctx_lo=offsets.clone(),
        ctx_hi=offsets + anchors,
    )
    return ids, feats, layout


def test_shapes():
    d = tiny_drafter()
    gen = torch.Generator().manual_seed(0)
    _ids, feats, layout = packed_two_sequences(d, gen)
    h = d(feats, layout)
    assert h.shape == (5, GAMMA, H)
    prev = torch.randint(0, V, (5, GAMMA), generator=gen)
    assert d.draft_logits(h, prev).shape == (5, GAMMA, V)
    assert d.confidence_logits(h, prev).shape == (5, GAMMA)
    assert d.fc.weight.shape == (H, 2 * H)


@pytest.mark.parametrize("block", [0, 1, 2, 3, 4])
def test_block_sees_only_context_before_its_anchor(block):
    """Perturbation test of the attention structure (no mask is inspected)."""
    d = tiny_drafter()
    gen = torch.Generator().manual_seed(1)
    _ids, feats, layout = packed_two_sequences(d, gen)
    with torch.no_grad():
        ref = d(feats, layout)[block]
        lo, hi = int(layout.ctx_lo[block]), int(layout.ctx_hi[block])
        # Context at/after the anchor, and the other sequence's context: no effect.
        outside = torch.ones(feats.shape[0], dtype=torch.bool)
        outside[lo:hi] = False
        f2 = feats.clone()
        f2[outside] += torch.randn_like(f2[outside]) * 5
        # Other blocks' tokens (anchors): no effect.
        l2 = BlockLayout(**{k: v.clone() for k, v in vars(layout).items()})
        others = [b for b in range(5) if b != block]
        l2.block_ids[others, 0] = (l2.block_ids[others, 0] + 7) % (V - 1)
        torch.testing.assert_close(d(f2, l2)[block], ref, rtol=0, atol=0)
        # Context strictly before the anchor: changes every row of the block.
        if hi > lo:
            f3 = feats.clone()
            f3[hi - 1] += 5.0
            changed = (d(f3, layout)[block] - ref).abs().amax(dim=-1)
            assert bool((changed > 1e-4).all())


def test_block_is_bidirectional():
    """The anchor row reads the mask rows after it (bidirectional inside the block)."""
    d = tiny_drafter()
    gen = torch.Generator().manual_seed(2)
    _ids, feats, layout = packed_two_sequences(d, gen)
    with torch.no_grad():
        ref = d(feats, layout)
        l2 = BlockLayout(**{k: v.clone() for k, v in vars(layout).items()})
        l2.block_ids[0, GAMMA - 1] = 5  # a later row's token
        out = d(feats, l2)
    assert (out[0, 0] - ref[0, 0]).abs().max() > 1e-4
    torch.testing.assert_close(out[1:], ref[1:], rtol=0, atol=0)


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_markov_bias_depends_only_on_previous_token(head_type):
    """B_k changes only when x_{k-1} changes (given h_k): the head is first order."""
    d = tiny_drafter(head_type)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, GAMMA, H, generator=gen)
    prev = torch.randint(0, V, (2, GAMMA), generator=gen)
    with torch.no_grad():
        ref = d.draft_logits(hidden, prev)
        for j in range(GAMMA):  # change x_j, which is the "previous token" of position j+1
            p2 = prev.clone()
            p2[:, j] = (p2[:, j] + 1) % V
            out = d.draft_logits(hidden, p2)
            for k in range(GAMMA):
                diff = (out[:, k] - ref[:, k]).abs().max().item()
                if k == j:
                    assert diff > 1e-5
                else:
                    assert diff == 0.0


def test_rnn_head_reads_the_prefix_not_the_future():
    d = tiny_drafter("rnn")
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, GAMMA, H, generator=gen)
    prev = torch.randint(0, V, (2, GAMMA), generator=gen)
    with torch.no_grad():
        ref = d.draft_logits(hidden, prev)
        p2 = prev.clone()
        p2[:, 1] = (p2[:, 1] + 1) % V
        out = d.draft_logits(hidden, p2)
    assert (out[:, 0] == ref[:, 0]).all()
    assert all((out[:, k] - ref[:, k]).abs().max() > 1e-6 for k in range(1, GAMMA))


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_teacher_forced_logits_equal_sequential_sampling(head_type):
    """Training's block_bias with x_{k-1} = the sampled tokens equals serving's left-to-right
    loop (so teacher forcing trains exactly the distribution that is sampled)."""
    d = tiny_drafter(head_type)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, GAMMA, H, generator=gen)
    anchor = torch.randint(0, V, (3,), generator=gen)
    with torch.no_grad():
        base = d.base_logits(hidden)
        tokens, step_logits = sample_block(d.markov_head, base, hidden, anchor)
        prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
        torch.testing.assert_close(d.draft_logits(hidden, prev), step_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_target_features_follow_sglang_layer_convention(tmp_path, arch):
    """Feature l = output of HF layer l = the residual stream entering layer l + 1 (SGLang's
    capture point), concatenated in order; final hidden = the LM-head input."""
    make_tiny_target(tmp_path / "t", arch=arch)
    ids = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(0))
    layer_ids = [0, 2]
    adapter = TargetAdapter.from_pretrained(tmp_path / "t", layer_ids)
    feats = adapter.features(ids)
    # SGLang's capture: the input of decoder layer l + 1.
    inputs = {}
    hooks = [
        adapter.layers[i].register_forward_pre_hook(
            lambda m, a, kw, i=i: inputs.__setitem__(i, (a[0] if a else kw["hidden_states"])),
            with_kwargs=True,
        )
        for i in sglang_capture_points(layer_ids)
    ]
    with torch.no_grad():
        out = adapter.model(ids[None], output_hidden_states=True)
    for h in hooks:
        h.remove()
    H_t = adapter.hidden_size
    for n, l in enumerate(layer_ids):
        got = feats.context[:, n * H_t : (n + 1) * H_t]
        torch.testing.assert_close(got, inputs[l + 1][0])
        torch.testing.assert_close(got, out.hidden_states[l + 1][0])
    torch.testing.assert_close(adapter.logits(feats.final_hidden), out.logits[0])


def test_target_adapter_refuses_uncapturable_layer(tmp_path):
    make_tiny_target(tmp_path / "t")
    with pytest.raises(ValueError, match="last layer"):
        TargetAdapter.from_pretrained(tmp_path / "t", [0, 3])


# ------------------------------------------------------------------ SGLang parity
class _Pool:
    """Stands in for SGLang's KV pool: keeps what write_target_hidden_kv injects."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def set_kv_buffer(self, layer, loc, k, v, *scales) -> None:
        self.k[layer.layer_id] = k.reshape(k.shape[0], -1, layer.head_dim).clone()
        self.v[layer.layer_id] = v.reshape(v.shape[0], -1, layer.head_dim).clone()


class _EncoderOnlyVerifyAttention(nn.Module):
    """What SGLang's GPU backends compute for the draft's TARGET_VERIFY forward with
    ENCODER_ONLY layers (flashinfer/trtllm: causal=False over prefix + block): every block row
    attends to the injected prefix KV and to all rows of its block."""

    def __init__(self, radix, pool: _Pool) -> None:
        super().__init__()
        self.layer_id = radix.layer_id
        self.head_dim = radix.head_dim
        self.scaling = radix.scaling
        self.num_heads = radix.tp_q_head_num
        self.k_scale = self.v_scale = None
        self.pool = pool

    def forward(self, q, k, v, forward_batch, **kw):
        hd = self.head_dim
        g = q.shape[0]
        K = torch.cat([self.pool.k[self.layer_id], k.reshape(g, -1, hd)])
        Vv = torch.cat([self.pool.v[self.layer_id], v.reshape(g, -1, hd)])
        rep = self.num_heads // K.shape[1]
        K, Vv = K.repeat_interleave(rep, dim=1), Vv.repeat_interleave(rep, dim=1)
        s = torch.einsum("qhd,khd->hqk", q.reshape(g, -1, hd), K) * self.scaling
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), Vv).reshape(g, -1)


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_logits_equal_sglang_draft_model(tmp_path, head_type):
    """Same weights, same inputs: our drafter == SGLang 0.5.23's srt/models/dspark.py draft
    (context KV injection, block forward, target LM head, Markov head, confidence head)."""
    import sglang.srt.models.dspark  # noqa: F401  (a hard dependency: never skipped)
    from sglang.srt.models.dspark import project_through_lm_head
    from sglang.srt.runtime_context import get_parallel

    ours = tiny_drafter(head_type, seed=11)
    save_draft(ours, tmp_path / "draft", dtype=torch.float32)
    sgl = sglang_load_check(tmp_path / "draft").float().eval()

    gen = torch.Generator().manual_seed(12)
    a = 9  # anchor position: context = target features of positions 0..a-1
    ids = torch.randint(0, V - 1, (a + GAMMA,), generator=gen)
    feats = torch.randn(a + GAMMA, 2 * H, generator=gen)
    draft_tokens = torch.randint(0, V, (1, GAMMA), generator=gen)
    layout = single_sequence_layout(
        ids, torch.tensor([a]), block_size=GAMMA, mask_token_id=ours.config.mask_token_id
    )
    prev = torch.cat([ids[a : a + 1][None], draft_tokens[:, :-1]], dim=1)
    with torch.no_grad():
        h_ours = ours(feats, layout)
        base_ours = ours.base_logits(h_ours)
        corrected_ours = ours.draft_logits(h_ours, prev)
        conf_ours = ours.confidence_logits(h_ours, prev)

    from sglang.srt.layers.radix_attention import AttentionType

    # Our config.json makes SGLang build bidirectional (ENCODER_ONLY) full-attention layers,
    # which is what _EncoderOnlyVerifyAttention reproduces.
    for layer in sgl.layers:
        assert layer.self_attn.attn_type == AttentionType.ENCODER_ONLY
        assert layer.self_attn.sliding_window_size == -1
    pool = _Pool()
    for layer in sgl.layers:
        layer.self_attn.attn = _EncoderOnlyVerifyAttention(layer.self_attn.attn, pool)
    lm_head = SimpleNamespace(weight=ours.shared.lm_head_weight, quant_method=None)
    fake_tp = SimpleNamespace(world_size=1, rank_in_group=0)
    with torch.no_grad(), get_parallel().override(tp_group=fake_tp):
        sgl.write_target_hidden_kv(
            target_hidden=feats[:a], pool=pool, positions=torch.arange(a), cache_loc=torch.arange(a)
        )
        block_ids = layout.block_ids[0]
        out = sgl.forward(
            input_ids=block_ids,
            positions=torch.arange(a, a + GAMMA),
            forward_batch=SimpleNamespace(),
            input_embeds=nn.functional.embedding(block_ids, ours.shared.embed_weight),
        )
        h_sgl = out.hidden_states  # [gamma, H] (rows of the one request)
        base_sgl = project_through_lm_head(h_sgl, lm_head)
        head = sgl.markov_head
        state = head.init_state(h_sgl[None])
        corrected_sgl = []
        for k in range(GAMMA):
            bias, state = head.step_bias(prev[:, k], hidden_states=h_sgl[None, k], state=state)
            corrected_sgl.append(base_sgl[k] + bias[0])
        _conf, conf_raw = sgl.confidence_head.predict(
            h_sgl, anchor_tokens=ids[a : a + 1], draft_tokens=draft_tokens, markov_head=head
        )

    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(h_sgl, h_ours[0], **tol)
    torch.testing.assert_close(base_sgl, base_ours[0], **tol)
    torch.testing.assert_close(torch.stack(corrected_sgl), corrected_ours[0], **tol)
    torch.testing.assert_close(conf_raw, conf_ours, **tol)

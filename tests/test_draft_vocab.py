"""The reduced draft vocabulary: ranking, the file (EAGLE-3's d2t / t2d), its refusals, the
command, and the Markov step over the subset."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.formats.draft_vocab import (
    coverage,
    load_draft_vocab,
    save_draft_vocab,
    token_counts,
    top_tokens,
)
from sglang_dspark.drafter.training.data import TokenSequence


def _seq(ids, mask):
    return TokenSequence(torch.tensor(ids), torch.tensor(mask, dtype=torch.bool))


def test_counts_only_response_tokens_and_ranks_by_frequency():
    seqs = [_seq([1, 2, 3, 3, 4], [0, 0, 1, 1, 1]), _seq([2, 2, 4, 5], [1, 1, 1, 0])]
    counts = token_counts(seqs, 8)
    assert counts.tolist() == [0, 0, 2, 2, 2, 0, 0, 0]
    assert top_tokens(counts, 2).tolist() == [2, 3]  # ties to the lower id
    assert top_tokens(counts, 2, always=[7]).tolist() == [2, 7]  # forced, sorted ascending
    assert coverage(counts, torch.tensor([2, 3])) == pytest.approx(4 / 6)
    with pytest.raises(DraftConfigError, match="outside the target vocabulary"):
        token_counts([_seq([9], [1])], 8)
    with pytest.raises(DraftConfigError, match="must be in 1..8"):
        top_tokens(counts, 9)


def test_file_round_trip_in_eagle3_format(tmp_path):
    ids = torch.tensor([0, 3, 4, 9])
    path = save_draft_vocab(tmp_path, ids, 12, data="x")
    raw = load_file(str(path))
    assert (raw["d2t"] + torch.arange(4)).tolist() == ids.tolist()  # target = draft + d2t
    assert raw["t2d"].nonzero()[:, 0].tolist() == ids.tolist()
    assert load_draft_vocab(tmp_path, 12).tolist() == ids.tolist()
    with pytest.raises(DraftConfigError, match="over 12 tokens, the target has 16"):
        load_draft_vocab(path, 16)


def test_corrupt_or_missing_files_are_refused_with_the_fix(tmp_path):
    with pytest.raises(DraftConfigError, match="sglang-dspark draft-vocab"):
        load_draft_vocab(tmp_path / "none.safetensors")
    bad = tmp_path / "bad.safetensors"
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[1, 2]] = True
    save_file({"d2t": torch.tensor([1, 5]), "t2d": t2d}, str(bad))  # ids 1, 6: mask says 1, 2
    with pytest.raises(DraftConfigError, match="disagree"):
        load_draft_vocab(bad)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DraftConfigError, match="cannot be read"):
        load_draft_vocab(tmp_path / "junk.safetensors")


def test_command_writes_the_most_frequent_tokens(embedded_paths, tmp_path):
    from sglang_dspark.cli import main

    data = tmp_path / "data.jsonl"
    rows = [{"input_ids": [5, 6, 7, 7, 7, 8], "loss_mask": [0, 1, 1, 1, 1, 1]}] * 3
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "vocab"
    assert main(["draft-vocab", "--data", str(data), "--target", str(embedded_paths.target),
                 "--size", "64", "--out", str(out)]) == 0  # fmt: skip
    ids = load_draft_vocab(out, 49152)
    assert len(ids) == 64 and {6, 7, 8} <= set(ids.tolist())
    assert 2 in ids.tolist()  # <|im_end|>, the end of a turn, is always in


def test_subset_markov_step_is_the_full_step_restricted():
    """Greedy rows pick the full step's argmax over the subset; the kept step logits are the
    full step's columns; sampled rows draw subset tokens."""
    from sglang.srt.models.dspark import VanillaMarkov

    from sglang_dspark.plugin.cpu_draft import DraftVocab, subset_step

    torch.manual_seed(0)
    vocab, hidden = 64, 8
    markov = VanillaMarkov(vocab_size=vocab, markov_rank=4)
    lm = torch.randn(vocab, hidden)
    ids = torch.arange(0, vocab, 3)
    sub = DraftVocab(ids, lm[ids].contiguous(), markov.markov_w2.weight[ids].contiguous())
    h = torch.randn(3, hidden)
    prev = torch.tensor([1, 5, 9])
    kept = torch.empty(3, len(ids))
    with torch.no_grad():
        tokens = subset_step(markov, sub, prev, h @ sub.lm_weight.T,
                             temperatures=torch.tensor([0.0, 1.0, 0.0]), seed=3,
                             logits_out=kept)  # fmt: skip
        full = (h @ lm.T + markov.markov_w2(markov.get_prev_embeddings(prev))).float()
    torch.testing.assert_close(kept, full[:, ids])
    masked = torch.full_like(full, float("-inf"))
    masked[:, ids] = full[:, ids]
    assert tokens[0] == masked[0].argmax() and tokens[2] == masked[2].argmax()
    assert int(tokens[1]) in ids.tolist()

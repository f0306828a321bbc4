"""A reduced draft vocabulary: the drafter proposes only from the N most frequent target tokens.

On a CPU the draft pass is bound by reading full-vocabulary weights: the LM head (49k x 576 for
SmolLM2) once per pass and the Markov head's W2 (49k x rank) once per drafted position, then a
softmax or argmax over 49k words per row. Restricted to the N tokens the target emits most in
the training data (FR-Spec's frequency-ranked subset), each of those passes reads N rows.

Verification stays exact: the draft distribution is the drafter's softmax over the subset (zero
elsewhere), the tokens are sampled from it, and rejection sampling against the full target
distribution accepts x with min(1, p(x) / q(x)) and resamples from max(0, p - q) (a token
outside the subset keeps all of its target mass in the residual). What a smaller N costs is
acceptance: target mass outside the subset is never proposed.

File format: safetensors with EAGLE-3's tensors (SGLang's format for a reduced draft vocab):
`d2t` [N] int64, target id = draft id + d2t[draft id], and `t2d` [V] bool, the subset's mask
over the target vocabulary; metadata names the source data and the counts. A draft directory
ships it as `draft_vocab/vocab.safetensors`, which the server then uses
(`plugin/cpu_draft.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from sglang_dspark.drafter.config import DraftConfigError

# Inside a draft checkpoint, in a subfolder: SGLang loads every top-level *.safetensors of a
# checkpoint as weights.
FILE_NAME = "draft_vocab/vocab.safetensors"


def token_counts(sequences: Iterable, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each token is a response token (loss mask 1), the tokens
    a drafter is asked to propose."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = seq.input_ids[seq.loss_mask]
        if len(ids) and int(ids.max()) >= vocab_size:
            raise DraftConfigError(
                f"token id {int(ids.max())} in the data is outside the target vocabulary "
                f"({vocab_size}); was the data tokenised for another model?"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def top_tokens(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties to the lower id), `always` included (special tokens
    such as the end of a turn), sorted ascending."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise DraftConfigError(f"draft vocabulary size {size} must be in 1..{vocab}")
    always = sorted({int(t) for t in always})
    if any(not 0 <= t < vocab for t in always) or len(always) > size:
        raise DraftConfigError(f"forced tokens {always} do not fit a vocabulary of {size}")
    rank = counts.to(torch.float64).clone()
    rank[always] = float("inf")
    order = torch.argsort(-rank, stable=True)
    return order[:size].sort().values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the counted tokens inside the subset."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def save_draft_vocab(path: str | Path, ids: torch.Tensor, vocab_size: int, **meta) -> Path:
    from safetensors.torch import save_file

    ids = ids.to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    d2t = ids - torch.arange(len(ids), dtype=torch.int64)
    save_file({"d2t": d2t, "t2d": t2d}, str(path),
              metadata={k: str(v) for k, v in meta.items()})  # fmt: skip
    return path


def load_draft_vocab(path: str | Path, vocab_size: int | None = None) -> torch.Tensor:
    """The subset's target ids [N] (int64, ascending) from a draft-vocab file; refuses a file
    whose mask disagrees with its ids or whose vocabulary is not `vocab_size`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    try:
        tensors = load_file(str(path))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise DraftConfigError(
            f"draft vocabulary {path} cannot be read ({e}); make one with "
            "`sglang-dspark draft-vocab`"
        ) from e
    if set(tensors) != {"d2t", "t2d"}:
        raise DraftConfigError(
            f"draft vocabulary {path} needs tensors d2t and t2d, has {sorted(tensors)}"
        )
    d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    ids = d2t + torch.arange(len(d2t))
    if (
        len(ids) == 0
        or bool((ids[1:] <= ids[:-1]).any())
        or int(ids[0]) < 0
        or int(ids[-1]) >= len(t2d)
        or int(t2d.sum()) != len(ids)
        or not bool(t2d[ids].all())
    ):
        raise DraftConfigError(f"draft vocabulary {path}: d2t and t2d disagree (corrupt file?)")
    if vocab_size is not None and len(t2d) != vocab_size:
        raise DraftConfigError(
            f"draft vocabulary {path} is over {len(t2d)} tokens, the target has {vocab_size}; "
            "make it from this target's data"
        )
    return ids


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="training data (a JSONL file or a directory)")
    p.add_argument("--target", required=True, help="the target checkpoint (its vocabulary)")
    p.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary")
    p.add_argument(
        "--out", required=True, help=f"a .safetensors file, or a directory ({FILE_NAME})"
    )
    p.add_argument("--max-length", type=int, default=4096, help="tokens read per sequence")


def run(args) -> int:
    import json

    from transformers import AutoConfig, AutoTokenizer

    from sglang_dspark.drafter.training.data import load_sequences

    vocab = int(AutoConfig.from_pretrained(args.target).vocab_size)
    tok = AutoTokenizer.from_pretrained(args.target)
    always = [t for t in (*tok.all_special_ids, tok.eos_token_id) if t is not None and t < vocab]
    seqs = load_sequences(args.data, max_length=args.max_length)
    counts = token_counts(seqs, vocab)
    ids = top_tokens(counts, args.size, always)
    share = coverage(counts, ids)
    path = save_draft_vocab(
        args.out, ids, vocab, data=args.data, sequences=len(seqs), tokens=int(counts.sum()),
        coverage=f"{share:.6f}", forced=json.dumps(sorted(set(always))),
    )  # fmt: skip
    print(f"{path}: {len(ids)} of {vocab} tokens, {share:.2%} of the {int(counts.sum())} response "
          f"tokens in {len(seqs)} sequences")  # fmt: skip
    return 0

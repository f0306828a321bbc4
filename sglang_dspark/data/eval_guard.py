"""Keep the evaluation prompts (sglang_dspark/assets/eval/*.jsonl) out of the training prompts.

A training prompt is dropped when, after normalisation (NFKC, lower case, words only):
* it equals an eval turn, or contains one (eval turns of at least `min_contained_words`), or
* it shares word 8-grams with one eval turn covering >= `threshold` of that turn's 8-grams
  (the eval prompt is mostly inside it), or >= `threshold` of its own 8-grams are eval
  8-grams (it is mostly eval text).
8-grams that occur in many eval turns are boilerplate ("Please reason step by step, and put
your final answer within ...") and are not evidence of overlap; they are ignored.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from sglang_dspark.evaluation.benchmarks import default_eval_dir

NGRAM = 8
_WORD = re.compile(r"\w+")


def normalise(text: str) -> str:
    return " ".join(_WORD.findall(unicodedata.normalize("NFKC", text).lower()))


def _ngrams(words: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def prompt_text(prompt: dict) -> str:
    return "\n".join(m["content"] for m in prompt["messages"] if m["role"] == "user")


class EvalGuard:
    def __init__(
        self,
        eval_turns: Iterable[str],
        threshold: float = 0.5,
        min_contained_words: int = 8,
        boilerplate_turns: int = 5,
    ):
        self.threshold = threshold
        self.min_contained_words = min_contained_words
        self.turns = [normalise(t) for t in eval_turns if t.strip()]
        self.exact = set(self.turns)
        grams_per_turn = [_ngrams(t.split()) for t in self.turns]
        freq = Counter(g for grams in grams_per_turn for g in grams)
        self.index: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self.size: list[int] = []
        for i, grams in enumerate(grams_per_turn):
            kept = {g for g in grams if freq[g] <= boilerplate_turns}
            self.size.append(len(kept))
            for g in kept:
                self.index[g].append(i)
        self.unindexed = [t for t, n in zip(self.turns, self.size) if n == 0]
        self.dropped: Counter[str] = Counter()  # per domain

    @classmethod
    def from_dir(cls, eval_dir: str | os.PathLike | None = None, **kwargs) -> EvalGuard:
        path = Path(eval_dir) if eval_dir else default_eval_dir()
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else []
        if not files:
            raise FileNotFoundError(
                f"no eval prompts (*.jsonl) at {path}; the guard that keeps them out of the "
                "training data needs them. Set DSPARK_EVAL_DIR (or --eval-dir) to the "
                "directory of gsm8k/humaneval/mt-bench .jsonl files, or pass --no-eval-guard."
            )
        turns: list[str] = []
        for f in files:
            for line in f.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    turns.extend(json.loads(line)["turns"])
        guard = cls(turns, **kwargs)
        guard.source = str(path)
        return guard

    def overlaps(self, text: str) -> bool:
        norm = normalise(text)
        if not norm:
            return False
        if norm in self.exact:
            return True
        if any(
            len(t.split()) >= self.min_contained_words and t in norm for t in self._candidates(norm)
        ):
            return True
        grams = _ngrams(norm.split())
        if not grams:
            return False
        shared: Counter[int] = Counter()
        in_eval = 0
        for g in grams:
            hits = self.index.get(g)
            if hits:
                in_eval += 1
                shared.update(hits)
        if in_eval / len(grams) >= self.threshold:
            return True
        return any(n / self.size[i] >= self.threshold for i, n in shared.items() if self.size[i])

    def _candidates(self, norm: str) -> list[str]:
        # A contained turn shares all its indexed 8-grams, so only turns hit by one (or with
        # none indexed) can be contained; avoids scanning every turn for every prompt.
        ids = {i for g in _ngrams(norm.split()) for i in self.index.get(g, ())}
        return [self.turns[i] for i in ids] + self.unindexed

    def keep(self, prompt: dict) -> bool:
        """False (and counted) for a prompt that overlaps the eval set."""
        if self.overlaps(prompt_text(prompt)):
            self.dropped[prompt["domain"]] += 1
            return False
        return True

"""Benchmark prompts: JSONL files of {"turns": [...]}, first turn through the chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_BENCHMARKS = ("gsm8k", "humaneval", "mt-bench")
DOMAINS = {"gsm8k": "math", "humaneval": "code", "mt-bench": "chat"}


# The public benchmark prompts shipped in the package (sources and licences: its README.md).
PACKAGED_EVAL_DIR = Path(__file__).resolve().parents[1] / "assets" / "eval"


def default_eval_dir() -> Path:
    """$DSPARK_EVAL_DIR, else the benchmark prompts shipped in the package."""
    env = os.environ.get("DSPARK_EVAL_DIR")
    if env:
        return Path(env)
    return PACKAGED_EVAL_DIR


def load_prompts(eval_dir: str | Path, benchmark: str, limit: int | None = None) -> list[str]:
    """First turn of each ``{"turns": [...]}`` line of ``eval_dir/benchmark.jsonl``."""
    path = Path(eval_dir) / f"{benchmark}.jsonl"
    if not path.is_file():
        have = sorted(p.stem for p in Path(eval_dir).glob("*.jsonl"))
        raise FileNotFoundError(
            f"benchmark file {path} does not exist (benchmarks found in {eval_dir}: "
            f"{have or 'none'}); pass --eval-dir or set DSPARK_EVAL_DIR to the folder holding "
            f"{benchmark}.jsonl, or drop {benchmark!r} from --benchmarks."
        )
    prompts: list[str] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f'{path}:{lineno}: expected a JSON object {{"turns": ["..."]}} ({e!r})'
                ) from e
            if not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of strings")
            prompts.append(turns[0])
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts

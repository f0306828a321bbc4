"""Training prompts in three domains, deterministic given a seed, eval prompts kept out.

    code  - CPython stdlib functions with varied instructions   (stdlib_code.py)
    chat  - Python docs / FAQ turned into user questions          (python_docs.py)
    math  - generated word problems asking for worked solutions  (word_problems.py)
    writing - open-ended chat: emails, stories, advice, role-play (writing.py; not in the
              default set, ask for it with ``--domains code,chat,math,writing``)

Each prompt is ``{"domain", "id", "messages": [{"role": "user", "content": ...}]}`` (math
prompts also carry the reference ``answer`` and ``solution``). Every stream is prefix-stable:
the first N prompts of a seed do not depend on how many are asked for, so a dataset can grow.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sglang_dspark.data.eval_guard import EvalGuard

DOMAINS = ("code", "chat", "math")  # the default set
ALL_DOMAINS = (*DOMAINS, "writing")


def prompt_stream(domain: str, seed: int) -> Iterator[dict]:
    if domain == "code":
        from sglang_dspark.data.stdlib_code import code_prompts

        return code_prompts(seed)
    if domain == "chat":
        from sglang_dspark.data.python_docs import chat_prompts

        return chat_prompts(seed)
    if domain == "math":
        from sglang_dspark.data.word_problems import math_prompts

        return math_prompts(seed)
    if domain == "writing":
        from sglang_dspark.data.writing import writing_prompts

        return writing_prompts(seed)
    raise ValueError(f"unknown prompt domain {domain!r}; expected one of {', '.join(ALL_DOMAINS)}")


def source_info(domains: Sequence[str]) -> dict:
    """What the prompts were made from, to compare runs across machines."""
    info: dict = {}
    if "code" in domains:
        from sglang_dspark.data.stdlib_code import stdlib_manifest

        info["code"] = {"stdlib": stdlib_manifest().summary()}
    if "chat" in domains:
        from sglang_dspark.data.python_docs import PACKAGE, ensure_python_docs

        marker = ensure_python_docs().parent / ".dspark-extracted"
        info["chat"] = {"package": marker.read_text().strip() if marker.exists() else PACKAGE}
    if "math" in domains:
        from sglang_dspark.data.word_problems import TEMPLATES

        info["math"] = {"templates": sorted({t.__name__ for t in TEMPLATES})}
    if "writing" in domains:
        from sglang_dspark.data.writing import SUBJECTS, TASKS, templates_sha256

        info["writing"] = {
            "tasks": len(TASKS),
            "subjects": len(SUBJECTS),
            "sha256": templates_sha256(),
        }
    return info


@dataclass
class PromptSet:
    seed: int
    by_domain: dict[str, list[dict]]
    dropped: dict[str, int] = field(default_factory=dict)  # eval overlaps, per domain
    sources: dict = field(default_factory=dict)

    def interleaved(self) -> list[dict]:
        """code0, chat0, math0, code1, ...: a partial run covers every domain."""
        out: list[dict] = []
        lists = list(self.by_domain.values())
        for i in range(max((len(v) for v in lists), default=0)):
            out.extend(v[i] for v in lists if i < len(v))
        return out


def build_prompts(
    per_domain: int,
    seed: int,
    domains: Sequence[str] = DOMAINS,
    guard: EvalGuard | None = None,
) -> PromptSet:
    """The first `per_domain` prompts of each domain's stream that pass the eval guard."""
    by_domain: dict[str, list[dict]] = {}
    for domain in domains:
        kept: list[dict] = []
        for prompt in prompt_stream(domain, seed):
            if len(kept) >= per_domain:
                break
            if guard is None or guard.keep(prompt):
                kept.append(prompt)
        if len(kept) < per_domain:
            raise ValueError(
                f"the {domain} source has only {len(kept)} prompts (after the eval guard); "
                f"asked for {per_domain}. Lower --per-domain."
            )
        by_domain[domain] = kept
    dropped = {d: guard.dropped[d] for d in domains} if guard is not None else {}
    return PromptSet(seed, by_domain, dropped, source_info(domains))


def write_prompts(path: str | os.PathLike, prompts: Sequence[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_prompts(path: str | os.PathLike) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

"""Regenerate responses with the target itself and write training sequences.

Each prompt is chat-templated with the target's tokenizer (``add_generation_prompt=True``),
the target continues it, and one JSONL line is written per prompt:

    {"id", "domain", "input_ids": prompt ids + response ids, "loss_mask": 0 on the prompt,
     1 on the response, "finish": "stop" | "length"}

The response keeps the end-of-turn token when the target produced it (``<|im_end|>`` for
SmolLM2); a response cut at ``max_new_tokens`` has none.

Backends (one interface, `GenerationBackend`):
* ``sglang`` - a running server's native ``/generate`` endpoint, fed ``input_ids`` and
  returning ``output_ids``: exactly the tokens the target produced, no re-tokenisation.
  A thread pool keeps ``concurrency`` requests in flight.
* ``hf``     - transformers ``generate``, batched with left padding (small targets, tests).

Output: ``OUT/{domain}.jsonl`` (what ``drafter/train.py --data OUT`` reads), ``OUT/run.json``
(the settings the shards were made with; a rerun with other settings is refused) and
``OUT/summary.json``. Resumable: ids already in a shard are skipped; each finished sequence is
appended and flushed at once, so a kill loses only the requests in flight (one batch).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def describe(self) -> dict:
        d = {"mode": "greedy" if self.greedy else "sample", "max_new_tokens": self.max_new_tokens}
        if not self.greedy:
            d.update(temperature=self.temperature, top_p=self.top_p, seed=self.seed)
        return d


@dataclass
class Completion:
    output_ids: list[int]  # the response as the target produced it (stop token included)
    finish: str  # "stop" | "length"


class GenerationBackend(Protocol):
    name: str
    model: str
    in_flight: int  # prompts generated together: what a kill can lose

    def generate(
        self, prompts: Sequence[list[int]], sampling: Sampling
    ) -> Iterator[tuple[int, Completion]]:
        """Yield (index into prompts, completion) as each one finishes, in any order."""
        ...


def stop_token_ids(tokenizer, target_dir: str | os.PathLike | None = None) -> set[int]:
    """End-of-turn ids: the tokenizer's eos plus generation_config's eos_token_id(s)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if target_dir is not None:
        gen = Path(target_dir) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The target's chat template, with the assistant turn opened."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sequence_record(prompt: dict, prompt_ids: list[int], completion: Completion) -> dict:
    response = list(completion.output_ids)
    return {
        "id": prompt["id"],
        "domain": prompt["domain"],
        "input_ids": list(prompt_ids) + response,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(response),
        "finish": completion.finish,
    }


def _trim_at_stop(ids: list[int], stop_ids: set[int], max_new_tokens: int) -> Completion:
    for i, t in enumerate(ids):
        if t in stop_ids:
            return Completion(ids[: i + 1], "stop")
    return Completion(ids[:max_new_tokens], "length")


# ---------------------------------------------------------------- backends
class HFBackend:
    """transformers `generate`, batched with left padding."""

    name = "hf"

    def __init__(
        self,
        target_dir: str | os.PathLike,
        batch_size: int = 8,
        dtype: str = "auto",
        model=None,
        tokenizer=None,
        device: str = "auto",
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from sglang_dspark.drafter.training.runtime import resolve_device

        self.model = str(target_dir)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(target_dir)
        if model is None:
            torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
            model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch_dtype)
        self.device = resolve_device(device)
        self.lm = model.eval().to(self.device)
        self.in_flight = batch_size
        self.stop_ids = stop_token_ids(self.tokenizer, target_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.stop_ids)

    def generate(self, prompts, sampling):
        import torch

        if not sampling.greedy:
            torch.manual_seed(sampling.seed)
        for start in range(0, len(prompts), self.in_flight):
            batch = prompts[start : start + self.in_flight]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            kwargs: dict = {"do_sample": False}
            if not sampling.greedy:
                kwargs = {
                    "do_sample": True,
                    "temperature": sampling.temperature,
                    "top_p": sampling.top_p,
                }
            with torch.no_grad():
                out = self.lm.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    max_new_tokens=sampling.max_new_tokens,
                    eos_token_id=sorted(self.stop_ids),
                    pad_token_id=self.pad_id,
                    top_k=None,
                    **kwargs,
                )
            for row in range(len(batch)):
                new = out[row, width:].tolist()
                yield start + row, _trim_at_stop(new, self.stop_ids, sampling.max_new_tokens)


class SGLangBackend:
    """A running SGLang server's native /generate endpoint (token ids in, token ids out)."""

    name = "sglang"

    def __init__(
        self, base_url: str, concurrency: int = 16, timeout_s: float = 600.0, retries: int = 2
    ):
        import requests

        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.in_flight = concurrency
        self.timeout_s, self.retries = timeout_s, retries
        self._local = threading.local()
        try:
            info = requests.get(f"{self.base_url}/model_info", timeout=10)
            info.raise_for_status()
        except requests.RequestException as e:
            raise RuntimeError(
                f"no SGLang server answers at {self.base_url} ({e}). Start one, e.g. "
                "`python -m sglang.launch_server --model-path TARGET --port 30000`, and pass "
                "--base-url http://HOST:PORT."
            ) from e
        self.model = info.json().get("model_path", "?")

    def _session(self):
        import requests

        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _one(self, ids: list[int], sampling: Sampling, index: int) -> Completion:
        import requests

        params = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature}
        if not sampling.greedy:
            params.update(top_p=sampling.top_p, sampling_seed=sampling.seed + index)
        body = {"input_ids": ids, "sampling_params": params, "stream": False}
        for attempt in range(self.retries + 1):
            try:
                r = self._session().post(
                    f"{self.base_url}/generate", json=body, timeout=self.timeout_s
                )
                r.raise_for_status()
                break
            except requests.RequestException as e:
                if attempt == self.retries:
                    detail = getattr(e.response, "text", "")[:300] if e.response is not None else ""
                    raise RuntimeError(f"{self.base_url}/generate failed: {e} {detail}") from e
                time.sleep(1.0 + attempt)
        out = r.json()
        if "output_ids" not in out:
            raise RuntimeError(
                f"{self.base_url}/generate returned no output_ids (keys: {sorted(out)}); "
                "the sglang backend needs SGLang's native /generate endpoint."
            )
        output_ids = list(out["output_ids"])
        reason = (out.get("meta_info") or {}).get("finish_reason") or {}
        if reason.get("type") == "stop":
            matched = reason.get("matched")
            # The stop token belongs to the response; add it if the server trimmed it.
            if isinstance(matched, int) and (not output_ids or output_ids[-1] != matched):
                output_ids.append(matched)
            return Completion(output_ids, "stop")
        return Completion(output_ids, "length")

    def generate(self, prompts, sampling):
        pool = cf.ThreadPoolExecutor(self.in_flight)
        pending: dict[cf.Future, int] = {}
        todo = iter(range(len(prompts)))
        try:
            for i in todo:
                pending[pool.submit(self._one, prompts[i], sampling, i)] = i
                if len(pending) >= self.in_flight:
                    break
            while pending:
                done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    yield i, fut.result()
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending[pool.submit(self._one, prompts[nxt], sampling, nxt)] = nxt
        finally:
            # Interrupted: drop what is queued; requests already sent finish in the background.
            pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- shards
class ShardSet:
    """One append-only JSONL file per domain under `out_dir`."""

    def __init__(self, out_dir: str | os.PathLike):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, object] = {}

    def path(self, domain: str) -> Path:
        return self.dir / f"{domain}.jsonl"

    def done_ids(self, domain: str) -> set[str]:
        path = self.path(domain)
        if not path.exists():
            return set()
        _repair_tail(path)
        with path.open(encoding="utf-8") as f:
            return {json.loads(line)["id"] for line in f if line.strip()}

    def append(self, record: dict) -> None:
        domain = record["domain"]
        if domain not in self._files:
            self._files[domain] = self.path(domain).open("a", encoding="utf-8")
        f = self._files[domain]
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self._files.values():
            os.fsync(f.fileno())
            f.close()
        self._files.clear()

    def stats(self, domain: str) -> dict:
        path = self.path(domain)
        counts: Counter[str] = Counter()
        if path.exists():
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    response = sum(rec["loss_mask"])
                    counts["sequences"] += 1
                    counts["prompt_tokens"] += len(rec["input_ids"]) - response
                    counts["response_tokens"] += response
                    counts[f"finish_{rec.get('finish', '?')}"] += 1
        return dict(counts)


def _repair_tail(path: Path) -> None:
    """Drop a torn last line (a kill in the middle of a write) so appends stay valid JSONL."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - cut)
        with path.open("r+b") as f:
            f.truncate(cut)


# ---------------------------------------------------------------- the run
def check_run_settings(out_dir: Path, settings: dict) -> None:
    """Refuse to mix shards made with different settings in one directory."""
    path = out_dir / "run.json"
    if path.exists():
        before = json.loads(path.read_text())
        diff = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if diff:
            lines = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{out_dir} holds data generated with other settings ({lines}); use a new "
                "--out directory (or delete that one) to generate with these settings."
            )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")


def generate_dataset(
    prompts: Sequence[dict],
    backend: GenerationBackend,
    tokenizer,
    out_dir: str | os.PathLike,
    sampling: Sampling,
    settings: dict | None = None,
    max_prompt_tokens: int = 1024,
    progress: bool = True,
    extra_summary: dict | None = None,
) -> dict:
    """Generate the responses still missing under `out_dir`; return (and write) the summary.

    `settings` identify the data (model, sampling, seed, prompt sources); they are recorded in
    OUT/run.json and must match on a rerun.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    check_run_settings(out, {**(settings or {}), "sampling": sampling.describe()})
    shards = ShardSet(out)
    domains = sorted({p["domain"] for p in prompts})
    done = set().union(*(shards.done_ids(d) for d in domains)) if domains else set()
    todo, todo_ids, too_long = [], [], 0
    for p in prompts:
        if p["id"] in done:
            continue
        ids = chat_prompt_ids(tokenizer, p["messages"])
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        todo.append(p)
        todo_ids.append(ids)
    logger.info(
        "%d prompts: %d done already, %d to generate, %d longer than %d tokens",
        len(prompts),
        len(prompts) - len(todo) - too_long,
        len(todo),
        too_long,
        max_prompt_tokens,
    )
    t0, new_tokens, written = time.perf_counter(), 0, 0
    bar = tqdm(
        total=len(todo),
        unit="seq",
        smoothing=0,  # batches arrive in bursts: the run's mean rate, not the last burst's
        disable=not progress,
        dynamic_ncols=True,
        desc=f"generate ({backend.name})",
    )
    try:
        for i, completion in backend.generate(todo_ids, sampling):
            shards.append(sequence_record(todo[i], todo_ids[i], completion))
            written += 1
            new_tokens += len(completion.output_ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.1f}")
    finally:
        bar.close()
        shards.close()
    elapsed = time.perf_counter() - t0
    summary = {
        "backend": backend.name,
        "model": backend.model,
        "sampling": sampling.describe(),
        **(settings or {}),
        "domains": {d: shards.stats(d) for d in domains},
        "skipped_prompt_too_long": too_long,
        "max_prompt_tokens": max_prompt_tokens,
        "last_run": {
            "sequences": written,
            "response_tokens": new_tokens,
            "seconds": round(elapsed, 2),
            "response_tokens_per_s": round(new_tokens / elapsed, 2) if elapsed > 0 else None,
            "in_flight": backend.in_flight,
        },
        **(extra_summary or {}),
    }
    summary["total"] = {
        k: sum(s.get(k, 0) for s in summary["domains"].values())
        for k in ("sequences", "prompt_tokens", "response_tokens")
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

"""Small client for SGLang's native /generate endpoint: token ids in, token ids out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user turn through the target's chat template (raw text without one):
    how the evaluator, the audit and the benchmarks encode a prompt for the target."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def generate_ids(
    base_url: str,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    timeout: float = 600.0,
    **sampling,
) -> dict:
    """One request; returns SGLang's JSON (with `output_ids` and `meta_info`)."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            **sampling,
        },
    }
    resp = requests.post(base_url + "/generate", json=body, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def generate_many(base_url: str, prompts: list[list[int]], concurrency: int = 8, **kw) -> list:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda ids: generate_ids(base_url, ids, **kw), prompts))

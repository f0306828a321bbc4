"""Small client for SGLang's native /generate endpoint: token ids in, token ids out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    """One user turn through the target's chat template (the evaluator's encoding)."""
    from sglang_dspark.evaluation.benchmarks import encode_chat

    return encode_chat(tokenizer, user_text)


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

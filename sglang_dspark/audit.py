"""`sglang-dspark audit`: is a running DSPARK server lossless?

Compares the server under test with a reference server of the same target without
speculation (same weights, same dtype):

1. Temperature 0: for each prompt the greedy token ids must be equal. A divergence counts as a
   numerical near-tie, not a failure, when the reference's top-2 log-probabilities at that
   position differ by less than `--tie-tolerance` nats (a verify window and a single decode step
   round differently in bf16; in float32 use a tiny tolerance).
2. Temperature 1: many short continuations from both; per prompt and generated position a
   chi-square test of homogeneity (sglang_dspark.losslessness) at a family-wise false-alarm
   rate `--alpha`.

Exit code 0 when both parts pass, 1 when either fails, 2 on a usage or connection error.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import requests

from sglang_dspark.losslessness import compare_samples

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]


@dataclass
class GreedyResult:
    prompt: int
    equal: bool
    first_divergence: int | None = None
    reference_gap: float | None = None  # top-1 minus top-2 log-prob at the divergence
    near_tie: bool = False


@dataclass
class AuditReport:
    server: str
    reference: str
    greedy: list[GreedyResult] = field(default_factory=list)
    sampling_summary: str = ""
    sampling_passed: bool = True
    drafts_accepted: int = 0
    drafts_proposed: int = 0

    @property
    def greedy_passed(self) -> bool:
        return all(g.equal or g.near_tie for g in self.greedy)

    @property
    def passed(self) -> bool:
        return self.greedy_passed and self.sampling_passed

    def render(self) -> str:
        lines = [f"audit of {self.server} against {self.reference}"]
        for g in self.greedy:
            if g.equal:
                state = "equal"
            elif g.near_tie:
                state = f"diverged at token {g.first_divergence} (near-tie, gap {g.reference_gap:.3g})"
            else:
                state = f"DIVERGED at token {g.first_divergence} (gap {g.reference_gap:.3g})"
            lines.append(f"  greedy prompt {g.prompt}: {state}")
        lines.append(f"  temperature 1: {self.sampling_summary}")
        lines.append(f"  drafts accepted {self.drafts_accepted} of {self.drafts_proposed}")
        lines.append("LOSSLESS" if self.passed else "NOT LOSSLESS")
        return "\n".join(lines)


def _post(url: str, body: dict, timeout: float) -> list[dict] | dict:
    resp = requests.post(url + "/generate", json=body, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def _tokenizer_path(url: str) -> str:
    """The target's directory as the reference server reports it (`/model_info`)."""
    info = requests.get(url + "/model_info", timeout=30).json()
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path:
        raise RuntimeError(f"{url}/model_info names no model path; pass --tokenizer DIR")
    return path


def audit(
    server: str,
    reference: str,
    prompt_ids: list[list[int]],
    *,
    greedy_tokens: int = 32,
    samples: int = 240,
    sample_tokens: int = 4,
    alpha: float = 0.01,
    tie_tolerance: float = 0.2,
    timeout: float = 1800,
) -> AuditReport:
    report = AuditReport(server, reference)
    greedy_params = {"max_new_tokens": greedy_tokens, "temperature": 0}
    for i, ids in enumerate(prompt_ids):
        a = _post(server, {"input_ids": ids, "sampling_params": greedy_params}, timeout)
        b = _post(
            reference,
            {"input_ids": ids, "sampling_params": greedy_params, "return_logprob": True,
             "top_logprobs_num": 2},
            timeout,
        )  # fmt: skip
        x, y = a["output_ids"], b["output_ids"]
        if x == y:
            report.greedy.append(GreedyResult(i, True))
            continue
        j = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        top = b["meta_info"].get("output_top_logprobs") or []
        gap = float("inf")
        if j < len(top) and top[j] and len(top[j]) >= 2:
            gap = float(top[j][0][0] - top[j][1][0])
        report.greedy.append(GreedyResult(i, False, j, gap, gap < tie_tolerance))

    sampled, reference_sampled = [], []
    params = {"max_new_tokens": sample_tokens, "temperature": 1.0, "ignore_eos": True}
    for ids in prompt_ids:
        rows = _post(server, {"input_ids": [ids] * samples, "sampling_params": params}, timeout)
        ref = _post(reference, {"input_ids": [ids] * samples, "sampling_params": params}, timeout)
        sampled.append([r["output_ids"] for r in rows])
        reference_sampled.append([r["output_ids"] for r in ref])
        report.drafts_accepted += sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in rows)
        report.drafts_proposed += sum(r["meta_info"].get("spec_num_proposed_drafts", 0) for r in rows)
    # position 0 comes from prefill, not from speculation
    result = compare_samples(sampled, reference_sampled, list(range(1, sample_tokens)), alpha=alpha)
    report.sampling_summary = result.summary()
    report.sampling_passed = result.passed
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the DSPARK server under test")
    parser.add_argument("--reference-url", required=True,
                        help="the same target served without speculation")  # fmt: skip
    parser.add_argument("--prompts", default=None, help="JSON lines of {'turns': [...]}")
    parser.add_argument("--tokenizer", default=None, help="target dir for the chat template")
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--sample-tokens", type=int, default=4)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.01, help="family-wise false-alarm rate")
    parser.add_argument("--tie-tolerance", type=float, default=0.2)
    parser.add_argument("--json", default=None, help="also write the report here")


def run(args: argparse.Namespace) -> int:
    texts = DEFAULT_PROMPTS
    if args.prompts:
        with open(args.prompts) as f:
            texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    try:
        info = requests.get(args.url + "/server_info", timeout=30).json()
    except requests.RequestException as exc:
        print(f"sglang-dspark audit: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if info.get("speculative_algorithm") != "DSPARK":
        print(f"note: {args.url} runs speculative_algorithm={info.get('speculative_algorithm')}")
    from transformers import AutoTokenizer

    from sglang_dspark.client import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(args.tokenizer or _tokenizer_path(args.reference_url))
    prompt_ids = [chat_prompt_ids(tok, t) for t in texts]
    report = audit(
        args.url, args.reference_url, prompt_ids, greedy_tokens=args.greedy_tokens,
        samples=args.samples, sample_tokens=args.sample_tokens, alpha=args.alpha,
        tie_tolerance=args.tie_tolerance,
    )  # fmt: skip
    print(report.render())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report) | {"passed": report.passed}, f, indent=2)
    return 0 if report.passed else 1

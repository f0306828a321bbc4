"""`sglang-dspark audit`: is a running speculative (DSPARK) server lossless?

Compares the server under test with a reference server of the same target without
speculation (same weights, same dtype). It passes only when all three parts pass:

1. Speculation happened. Every answer of a speculative SGLang server carries
   `meta_info.spec_verify_ct` (verify rounds) and `spec_num_correct_drafts` (accepted drafts);
   a server that proposed no draft, or had none accepted, fails: its output would equal the
   reference's without the sampler ever being exercised (a plain server must not pass). The
   server's own `/server_info` `avg_spec_accept_length` is shown beside the counts.
2. Temperature 0: for each prompt the greedy token ids must be equal. A divergence at token j
   (server x_j, reference y_j) is excused as a rounding near-tie only if the reference itself
   shows that rounding can flip it. The reference computes its continuation twice: once in its
   decode steps (one token per forward) and once in one multi-token prefill forward over the
   same tokens (the shape of a verify window). Same weights, same tokens: the two differ by
   rounding only. Let tau = max over t <= j of |logprob_decode(y_t) - logprob_prefill(y_t)|
   (how far rounding moves one log-probability here), and m = logprob(y_j) - logprob(x_j) the
   reference's margin. A margin is a difference of two log-probabilities, so rounding moves it
   by up to 2 tau: the divergence is a near-tie iff m_decode <= 2 tau, or the reference's own
   multi-token forward already prefers (or ties) the server's token (m_prefill <= 0). In
   float32 tau is ~1e-6 nats, so only exact ties pass; in bf16 logits are rounded to 8
   significant bits (0.06-0.12 nats at SmolLM2's logit scale) and tau measures that. A server
   token outside the reference's top-5 is never a near-tie.
3. Temperature 1: many short continuations from both; per prompt a chi-square test of
   homogeneity of the token at each generated position and one of the joint category of the
   first `--joint-tokens` tokens (sglang_dspark.verification.losslessness), at a family-wise false-alarm
   rate `--alpha`. The summary states the power: the smallest total-variation shift each kind
   of test detects with probability 0.8 at the sample size used.

`--reference-samples FILE` keeps the reference's temperature-1 continuations: written after
they are drawn, read by later audits against the same reference model, prompts and sampling
settings (the first `--samples` of them; more are drawn and added when it holds fewer), so that
several servers or settings are audited against one reference sample. A file drawn with other
settings, or not such a file, is refused.

Exit code 0 when all parts pass, 1 when any fails, 2 on a usage or connection error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from sglang_dspark.verification.losslessness import compare_samples

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]
TOP_K = 5  # reference log-probabilities asked for at each greedy position


@dataclass
class GreedyResult:
    prompt: int
    equal: bool
    first_divergence: int | None = None
    margin: float | None = None  # reference decode: logprob(its token) - logprob(server's)
    prefill_margin: float | None = None  # the same margin from one multi-token forward
    rounding: float | None = None  # tau: largest decode/prefill logprob change up to j
    near_tie: bool = False

    def describe(self) -> str:
        if self.equal:
            return "equal"
        j = self.first_divergence
        if self.margin is None:
            return f"DIVERGED at token {j} (server token not in the reference's top-{TOP_K})"
        detail = (
            f"reference margin {self.margin:.3g} nats, {self.prefill_margin:.3g} in a multi-token "
            f"forward; rounding moves its log-probabilities by up to {self.rounding:.3g}"
        )
        if self.near_tie:
            return f"diverged at token {j} (rounding near-tie: {detail})"
        return f"DIVERGED at token {j} ({detail})"


@dataclass
class AuditReport:
    server: str
    reference: str
    greedy: list[GreedyResult] = field(default_factory=list)
    sampling_summary: str = ""
    sampling_passed: bool = False
    sampling_tests: int = 0  # chi-square tests run, per position and joint
    sampling_joint_tests: int = 0
    detectable_tv_position: float | None = None
    detectable_tv_joint: float | None = None
    drafts_accepted: int = 0
    drafts_proposed: int = 0
    verify_rounds: int = 0
    server_accept_length: float | None = None  # /server_info internal_states

    @property
    def speculation_problem(self) -> str | None:
        if self.verify_rounds == 0 or self.drafts_proposed == 0:
            return (
                f"no draft was proposed: {self.server} answered without speculative decoding "
                "(no spec_verify_ct in meta_info); audit a server started with "
                "--speculative-algorithm, against a reference without it"
            )
        if self.drafts_accepted == 0:
            return (
                f"{self.drafts_proposed} drafts proposed and none accepted: the output is the "
                "target's own and says nothing about the rejection sampler; check the draft model"
            )
        return None

    @property
    def greedy_passed(self) -> bool:
        return all(g.equal or g.near_tie for g in self.greedy)

    @property
    def passed(self) -> bool:
        return self.speculation_problem is None and self.greedy_passed and self.sampling_passed

    def render(self) -> str:
        lines = [f"audit of {self.server} against {self.reference}"]
        accept = "" if self.server_accept_length is None else (
            f", server avg_spec_accept_length {self.server_accept_length:.3g}"
        )  # fmt: skip
        lines.append(
            f"  speculation: {self.drafts_accepted} of {self.drafts_proposed} drafts accepted "
            f"in {self.verify_rounds} verify rounds{accept}"
        )
        if self.speculation_problem:
            lines.append(f"  FAIL: {self.speculation_problem}")
        for g in self.greedy:
            lines.append(f"  greedy prompt {g.prompt}: {g.describe()}")
        lines.append(f"  temperature 1: {self.sampling_summary}")
        lines.append("LOSSLESS" if self.passed else "NOT LOSSLESS")
        return "\n".join(lines)


class ReferenceSamplesError(ValueError):
    """A --reference-samples file that cannot serve this audit (other settings, not one)."""


@dataclass
class ReferenceSamples:
    """The reference's temperature-1 continuations per prompt, on disk (`--reference-samples`).

    `key` says what they were drawn from: the reference's model path and dtype (its
    /server_info), the prompts' token ids and the sampling parameters."""

    path: Path
    key: dict
    samples: list[list[list[int]]]

    @classmethod
    def open(cls, path: str | Path, key: dict) -> ReferenceSamples:
        path = Path(path)
        if not path.exists():
            return cls(path, key, [[] for _ in key["prompt_ids"]])
        try:
            record = json.loads(path.read_text())
            stored, samples = record["key"], record["samples"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ReferenceSamplesError(
                f"{path} is not a reference-samples file of `sglang-dspark audit` ({exc}); "
                "give another --reference-samples path or delete it"
            ) from exc
        if stored != key:
            diff = sorted(k for k in set(key) | set(stored) if stored.get(k) != key.get(k))
            raise ReferenceSamplesError(
                f"{path} holds samples drawn with other settings (differing: {', '.join(diff)}); "
                "give another --reference-samples path, or delete it to draw anew"
            )
        return cls(path, key, samples)

    def take(self, i: int, n: int, draw: Callable[[int], list[list[int]]]) -> list[list[int]]:
        """The first `n` continuations of prompt `i`, drawing (and keeping) what is missing."""
        have = self.samples[i]
        if len(have) < n:
            have.extend(draw(n - len(have)))
        return have[:n]

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"key": self.key, "samples": self.samples}))
        tmp.replace(self.path)


def reference_samples_key(reference: str, prompt_ids: list[list[int]], params: dict) -> dict:
    info = requests.get(reference + "/server_info", timeout=30).json()
    return {
        "model_path": info.get("model_path"),
        "dtype": info.get("dtype"),
        "prompt_ids": prompt_ids,
        "sampling_params": params,
    }


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


def server_accept_length(url: str) -> float | None:
    """`avg_spec_accept_length` of the first scheduler in /server_info (None when absent:
    a server without speculation reports none)."""
    try:
        info = requests.get(url + "/server_info", timeout=30).json()
    except (requests.RequestException, ValueError):
        return None
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length")
    return None if value is None else float(value)


def _count_speculation(report: AuditReport, rows: list[dict]) -> None:
    for r in rows:
        meta = r["meta_info"]
        report.verify_rounds += meta.get("spec_verify_ct", 0)
        report.drafts_accepted += meta.get("spec_num_correct_drafts", 0)
        report.drafts_proposed += meta.get("spec_num_proposed_drafts", 0)


def _logprob_of(entries: list, token: int) -> float | None:
    """entries: SGLang's [logprob, token_id, text] triples at one position."""
    return next((float(e[0]) for e in entries or [] if e and e[1] == token), None)


def greedy_check(server: str, reference: str, i: int, ids: list[int], tokens: int,
                 timeout: float) -> tuple[GreedyResult, dict]:  # fmt: skip
    """Greedy equality for one prompt, with the rounding near-tie rule of the module docstring.
    Returns the result and the server's answer (for its speculation counts)."""
    params = {"max_new_tokens": tokens, "temperature": 0}
    a = _post(server, {"input_ids": ids, "sampling_params": params}, timeout)
    b = _post(
        reference,
        {"input_ids": ids, "sampling_params": params, "return_logprob": True,
         "top_logprobs_num": TOP_K},
        timeout,
    )  # fmt: skip
    x, y = a["output_ids"], b["output_ids"]
    if x == y:
        return GreedyResult(i, True), a
    j = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), None)
    if j is None:  # one is a prefix of the other: a different stop, not a different token
        return GreedyResult(i, False, min(len(x), len(y))), a
    top = (b["meta_info"].get("output_top_logprobs") or [])[j]
    lp_x, lp_y = _logprob_of(top, x[j]), _logprob_of(top, y[j])
    if lp_x is None or lp_y is None:
        return GreedyResult(i, False, j), a
    # y_0..y_j again, in one multi-token forward; SGLang's entry 0 is the last prompt token
    # (no logprob), entry k + 1 is y_k
    pre = _post(
        reference,
        {"input_ids": ids + y[: j + 1], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
         "return_logprob": True, "logprob_start_len": len(ids) - 1,
         "token_ids_logprob": [x[j], y[j]]},
        timeout,
    )  # fmt: skip
    meta = pre["meta_info"]
    chosen = meta.get("input_token_logprobs") or []
    if len(chosen) < j + 2 or any(chosen[k + 1][1] != y[k] for k in range(j + 1)):
        raise RuntimeError(
            f"{reference} returned input logprobs that do not line up with its own greedy "
            f"tokens (logprob_start_len {len(ids) - 1}); is it an SGLang server?"
        )
    decoded = b["meta_info"]["output_token_logprobs"]
    tau = max(abs(decoded[k][0] - chosen[k + 1][0]) for k in range(j + 1))
    at_j = (meta.get("input_token_ids_logprobs") or [None] * (j + 2))[j + 1]
    px, py = _logprob_of(at_j, x[j]), _logprob_of(at_j, y[j])
    if px is None or py is None:
        raise RuntimeError(f"{reference} returned no input logprobs for tokens {x[j]}, {y[j]}")
    m_dec, m_pre = lp_y - lp_x, py - px
    tie = m_dec <= 2 * tau or m_pre <= 0
    return GreedyResult(i, False, j, m_dec, m_pre, tau, tie), a


def audit(
    server: str,
    reference: str,
    prompt_ids: list[list[int]],
    *,
    greedy_tokens: int = 32,
    samples: int = 240,
    sample_tokens: int = 4,
    joint_tokens: int = 3,
    alpha: float = 0.01,
    timeout: float = 1800,
    reference_samples: str | Path | None = None,
) -> AuditReport:
    if not 1 <= joint_tokens <= sample_tokens:
        raise ValueError(
            f"--joint-tokens {joint_tokens} must be in 1..--sample-tokens ({sample_tokens})"
        )
    params = {"max_new_tokens": sample_tokens, "temperature": 1.0, "ignore_eos": True}
    store = None  # refused before any work when it cannot serve this audit
    if reference_samples is not None:
        key = reference_samples_key(reference, prompt_ids, params)
        store = ReferenceSamples.open(reference_samples, key)
    report = AuditReport(server, reference)
    for i, ids in enumerate(prompt_ids):
        result, answer = greedy_check(server, reference, i, ids, greedy_tokens, timeout)
        report.greedy.append(result)
        _count_speculation(report, [answer])
    if report.verify_rounds == 0:  # not speculative: sampling would only cost time
        report.sampling_summary = "skipped (no speculation to test)"
        return report

    sampled, reference_sampled = [], []
    for i, ids in enumerate(prompt_ids):
        rows = _post(server, {"input_ids": [ids] * samples, "sampling_params": params}, timeout)
        sampled.append([r["output_ids"] for r in rows])
        _count_speculation(report, rows)

        def draw(n: int, ids=ids) -> list[list[int]]:
            body = {"input_ids": [ids] * n, "sampling_params": params}
            return [r["output_ids"] for r in _post(reference, body, timeout)]

        reference_sampled.append(store.take(i, samples, draw) if store else draw(samples))
    if store is not None:
        store.save()
    report.server_accept_length = server_accept_length(server)
    # position 0 comes from prefill, not from speculation; the joint category starts there
    result = compare_samples(
        sampled, reference_sampled, list(range(1, sample_tokens)),
        joint_positions=tuple(range(joint_tokens)) if joint_tokens > 1 else None, alpha=alpha,
    )  # fmt: skip
    report.sampling_summary = result.summary()
    report.sampling_passed = result.passed
    report.sampling_tests = len(result.tests)
    report.sampling_joint_tests = sum(t.joint for t in result.tests)
    report.detectable_tv_position = result.detectable_tv(joint=False)
    report.detectable_tv_joint = result.detectable_tv(joint=True)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the speculative server under test")
    parser.add_argument("--reference-url", required=True,
                        help="the same target served without speculation")  # fmt: skip
    parser.add_argument("--prompts", default=None, help="JSON lines of {'turns': [...]}")
    parser.add_argument("--tokenizer", default=None, help="target dir for the chat template")
    parser.add_argument(
        "--samples", type=int, default=240, help="continuations per prompt and server"
    )
    parser.add_argument("--sample-tokens", type=int, default=4)
    parser.add_argument("--joint-tokens", type=int, default=3,
                        help="length of the leading continuation tested as one joint category")  # fmt: skip
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.01, help="family-wise false-alarm rate")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument(
        "--reference-samples", default=None, metavar="FILE",
        help="keep the reference's temperature-1 samples in FILE and reuse them in later "
        "audits against the same reference, prompts and settings",
    )  # fmt: skip


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

    from sglang_dspark.serving.client import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(args.tokenizer or _tokenizer_path(args.reference_url))
    prompt_ids = [chat_prompt_ids(tok, t) for t in texts]
    try:
        report = audit(
            args.url, args.reference_url, prompt_ids, greedy_tokens=args.greedy_tokens,
            samples=args.samples, sample_tokens=args.sample_tokens,
            joint_tokens=args.joint_tokens, alpha=args.alpha,
            reference_samples=args.reference_samples,
        )  # fmt: skip
    except ReferenceSamplesError as exc:
        print(f"sglang-dspark audit: {exc}", file=sys.stderr)
        return 2
    print(report.render())
    if args.json:
        with open(args.json, "w") as f:
            record = asdict(report) | {
                "passed": report.passed, "speculation_problem": report.speculation_problem,
            }  # fmt: skip
            json.dump(record, f, indent=2)
    return 0 if report.passed else 1

"""The training-data pipeline: prompt sources, eval guard, generation, resume."""

from __future__ import annotations

import argparse
import http.server
import itertools
import json
import threading
from pathlib import Path

import pytest
import torch

from sglang_dspark.data import cli as data_cli
from sglang_dspark.data.eval_guard import EvalGuard, normalise
from sglang_dspark.data.generate import (
    Completion,
    HFBackend,
    Sampling,
    SGLangBackend,
    chat_prompt_ids,
    generate_dataset,
)
from sglang_dspark.data.prompts import (
    ALL_DOMAINS,
    DOMAINS,
    build_prompts,
    prompt_stream,
    source_info,
)
from sglang_dspark.data.python_docs import ensure_python_docs
from sglang_dspark.data.stdlib_code import MAX_CODE_CHARS, SKIP_DIRS, stdlib_manifest
from sglang_dspark.data.word_problems import TEMPLATES, check_solution, math_problem
from sglang_dspark.data.writing import SUBJECTS, TASKS

torch.set_num_threads(1)


def _first(domain: str, seed: int, n: int) -> list[dict]:
    return list(itertools.islice(prompt_stream(domain, seed), n))


# ---------------------------------------------------------------- prompt sources
@pytest.mark.parametrize("domain", ALL_DOMAINS)
def test_prompts_are_deterministic_per_seed_and_prefix_stable(domain):
    a, b = _first(domain, 0, 40), _first(domain, 0, 40)
    assert a == b
    assert [p["id"] for p in _first(domain, 1, 40)] != [p["id"] for p in a]
    assert _first(domain, 0, 15) == a[:15]
    assert len({p["id"] for p in a}) == len(a)
    for p in a:
        assert p["domain"] == domain and p["id"].startswith(domain + "/")
        (msg,) = p["messages"]
        assert msg["role"] == "user" and len(msg["content"]) > 10


def test_code_prompts_come_from_a_pinned_stdlib_file_list():
    manifest = stdlib_manifest()
    assert list(manifest.files) == sorted(manifest.files)
    assert "json/decoder.py" in manifest.files
    assert not any(set(f.split("/")[:-1]) & SKIP_DIRS for f in manifest.files)
    assert len(manifest.sha256) == 64
    prompts = _first("code", 0, 300)
    kinds = {p["id"].rsplit("/", 1)[1] for p in prompts}
    assert {"explain", "docstring", "complete", "write", "bug", "tests"} <= kinds
    for p in prompts:
        path = p["id"].split("/", 1)[1].split(":")[0]
        assert path in manifest.files
        assert len(p["messages"][0]["content"]) < MAX_CODE_CHARS + 400


def test_chat_prompts_come_from_the_python_docs():
    sources = ensure_python_docs()
    assert (sources / "faq" / "programming.rst.txt").exists()
    assert ensure_python_docs() == sources  # idempotent
    prompts = _first("chat", 0, 400)
    kinds = {p["id"].rsplit("/", 1)[1].rstrip("0123456789") for p in prompts}
    assert kinds == {"faq", "topic", "glossary", "passage"}
    faq = [p["messages"][0]["content"] for p in prompts if "/faq/" in p["id"]]
    assert any("?" in q for q in faq)
    assert not any(":func:`" in p["messages"][0]["content"] for p in prompts)


def test_writing_prompts_cover_every_task_and_subject_once():
    prompts = list(prompt_stream("writing", 0))
    assert len(prompts) == len(TASKS) * len(SUBJECTS)
    assert len({p["messages"][0]["content"] for p in prompts}) == len(prompts)
    first = prompts[:200]  # an early prefix already mixes the kinds of request
    kinds = {p["id"].split("/")[1].rstrip("0123456789") for p in first}
    assert kinds == {kind for kind, _ in TASKS}
    assert not any("{" in p["messages"][0]["content"] for p in prompts)  # every slot filled


def test_writing_sources_change_when_a_subject_does(monkeypatch):
    from sglang_dspark.data import writing

    before = source_info(["writing"])["writing"]
    monkeypatch.setattr(writing, "SUBJECTS", (*SUBJECTS[:-1], "tide pools"))
    after = source_info(["writing"])["writing"]
    assert before["subjects"] == after["subjects"] and before["sha256"] != after["sha256"]


def test_unknown_domain_names_the_known_ones():
    with pytest.raises(ValueError, match="code, chat, math, writing"):
        prompt_stream("poetry", 0)


def test_math_problems_have_correct_worked_solutions():
    seen = set()
    for i in range(3000):
        problem = math_problem(7, i)
        check_solution(problem)
        seen.add(problem.template)
    assert len(seen) >= 8
    assert len(TEMPLATES) >= 8
    p = _first("math", 0, 1)[0]
    assert p["solution"].endswith("Answer: " + p["answer"])
    assert (
        "step" in p["messages"][0]["content"].lower()
        or "work" in p["messages"][0]["content"].lower()
    )


def test_check_solution_catches_a_wrong_step():
    import dataclasses

    problem = math_problem(0, 0)
    broken = dataclasses.replace(problem, steps=problem.steps[:-1] + ("2 + 2 = 5",))
    with pytest.raises(AssertionError):
        check_solution(broken)


# ---------------------------------------------------------------- eval guard
def test_eval_guard_drops_planted_eval_prompts(tmp_path):
    planted = _first("code", 0, 10)
    exact = planted[2]["messages"][0]["content"]
    near = next(i for i in range(3, 10) if "```python" in planted[i]["messages"][0]["content"])
    code = planted[near]["messages"][0]["content"].split("```python\n")[1].split("```")[0]
    turns = [
        {"turns": [exact.upper().replace("\n", "  ")]},  # the same after normalisation
        {"turns": ["Write a solution that passes the tests:\n" + code, "Now explain it."]},
        {"turns": ["Completely unrelated question about Hawaii travel and blog posts."]},
    ]
    (tmp_path / "planted.jsonl").write_text("\n".join(json.dumps(t) for t in turns))
    guard = EvalGuard.from_dir(tmp_path)
    result = build_prompts(10, 0, ["code"], guard)
    ids = {p["id"] for p in result.by_domain["code"]}
    assert planted[2]["id"] not in ids and planted[near]["id"] not in ids
    assert result.dropped == {"code": 2}
    assert len(ids) == 10  # refilled from further down the stream


def test_eval_guard_on_the_shared_eval_sets():
    guard = EvalGuard.from_dir()
    gsm = json.loads(Path(guard.source, "gsm8k.jsonl").read_text().splitlines()[3])["turns"][0]
    question = gsm.split("\nPlease reason")[0]
    assert guard.overlaps(gsm)
    assert guard.overlaps("Help me with this one: " + question + " Thanks!")
    # Shared boilerplate alone is not overlap.
    assert not guard.overlaps(
        "What is 17 + 25? Please reason step by step, and put your final answer within \\boxed{}."
    )
    assert normalise("Hello,   WORLD!") == "hello world"


def test_eval_guard_reports_a_missing_eval_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="DSPARK_EVAL_DIR"):
        EvalGuard.from_dir(tmp_path / "nowhere")


# ---------------------------------------------------------------- generation (hf)
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sglang_dspark.serving.smollm2 import ensure_smollm2

    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config).float().eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _small_prompts(n_per_domain: int = 2) -> list[dict]:
    out = []
    for i in range(n_per_domain):
        for d in DOMAINS:
            out.append(
                {
                    "domain": d,
                    "id": f"{d}/t{i}",
                    "messages": [
                        {
                            "role": "user",
                            "content": f"Question {i} about {d}" + " and more" * (i * 3),
                        }
                    ],
                }
            )
    return out


def test_hf_records_align_prompt_and_response(tiny_target, tmp_path):
    backend = HFBackend(tiny_target, batch_size=4, dtype="float32")
    prompts = _small_prompts()
    summary = generate_dataset(
        prompts, backend, backend.tokenizer, tmp_path, Sampling(max_new_tokens=6), progress=False
    )
    assert summary["total"]["sequences"] == len(prompts)
    assert summary["sampling"]["mode"] == "greedy"
    by_id = {p["id"]: p for p in prompts}
    for domain in DOMAINS:
        for line in (tmp_path / f"{domain}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            prompt_ids = chat_prompt_ids(backend.tokenizer, by_id[rec["id"]]["messages"])
            n = len(prompt_ids)
            assert len(rec["input_ids"]) == len(rec["loss_mask"])
            assert rec["input_ids"][:n] == prompt_ids
            assert rec["loss_mask"][:n] == [0] * n
            assert rec["loss_mask"][n:] == [1] * (len(rec["input_ids"]) - n)
            assert 1 <= len(rec["input_ids"]) - n <= 6
            assert rec["domain"] == domain
    text = backend.tokenizer.decode(prompt_ids)
    assert text.endswith("<|im_start|>assistant\n")


def test_hf_left_padding_matches_one_at_a_time(tiny_target):
    backend = HFBackend(tiny_target, batch_size=4, dtype="float32")
    tok = backend.tokenizer
    ids = [chat_prompt_ids(tok, p["messages"]) for p in _small_prompts()[:4]]
    assert len({len(x) for x in ids}) > 1  # really padded
    batched = dict(backend.generate(ids, Sampling(max_new_tokens=5)))
    single = HFBackend(tiny_target, batch_size=1, dtype="float32")
    alone = dict(single.generate(ids, Sampling(max_new_tokens=5)))
    assert {i: c.output_ids for i, c in batched.items()} == {
        i: c.output_ids for i, c in alone.items()
    }


def test_hf_response_keeps_the_stop_token(tiny_target):
    backend = HFBackend(tiny_target, batch_size=2, dtype="float32")
    ids = [chat_prompt_ids(backend.tokenizer, p["messages"]) for p in _small_prompts()[:2]]
    free = dict(backend.generate(ids, Sampling(max_new_tokens=4)))
    assert all(c.finish == "length" and len(c.output_ids) == 4 for c in free.values())
    # Declare the token the model emits third in row 0 a stop token: it must end there.
    stop = free[0].output_ids[2]
    backend.stop_ids = {stop}
    stopped = dict(backend.generate(ids, Sampling(max_new_tokens=4)))
    first = free[0].output_ids.index(stop)
    assert stopped[0].output_ids == free[0].output_ids[: first + 1]
    assert stopped[0].finish == "stop"


# ---------------------------------------------------------------- resume / kill
class ScriptedBackend:
    """Deterministic fake target: response = last prompt id + 1, ..., + 3, then eos (2)."""

    name, model = "fake", "fake-model"

    def __init__(self, in_flight: int = 4, fail_after: int | None = None):
        self.in_flight, self.fail_after = in_flight, fail_after
        self.asked: list[list[int]] = []

    def generate(self, prompts, sampling):
        self.asked.extend(prompts)
        produced = 0
        for start in range(0, len(prompts), self.in_flight):
            batch = prompts[start : start + self.in_flight]
            if self.fail_after is not None and produced + len(batch) > self.fail_after:
                raise KeyboardInterrupt("killed in the middle of a batch")
            for j, p in enumerate(batch):
                produced += 1
                yield start + j, Completion([p[-1] + 1, p[-1] + 2, p[-1] + 3, 2], "stop")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang_dspark.serving.smollm2 import ensure_smollm2

    return AutoTokenizer.from_pretrained(ensure_smollm2())


def _ids_in(out: Path) -> list[str]:
    return [
        json.loads(line)["id"]
        for d in DOMAINS
        if (out / f"{d}.jsonl").exists()
        for line in (out / f"{d}.jsonl").read_text().splitlines()
    ]


def test_rerun_skips_ids_already_generated(tokenizer, tmp_path):
    prompts = _small_prompts(4)  # 12
    first = ScriptedBackend()
    generate_dataset(prompts[:5], first, tokenizer, tmp_path, Sampling(8), progress=False)
    assert len(first.asked) == 5
    second = ScriptedBackend()
    summary = generate_dataset(prompts, second, tokenizer, tmp_path, Sampling(8), progress=False)
    assert len(second.asked) == 7
    ids = _ids_in(tmp_path)
    assert sorted(ids) == sorted(p["id"] for p in prompts)
    assert summary["total"]["sequences"] == 12 and summary["last_run"]["sequences"] == 7
    assert summary["total"]["response_tokens"] == 12 * 4


def test_killed_run_loses_at_most_one_batch(tokenizer, tmp_path):
    prompts = _small_prompts(4)  # 12 prompts, batches of 4
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(
            prompts,
            ScriptedBackend(in_flight=4, fail_after=10),
            tokenizer,
            tmp_path,
            Sampling(8),
            progress=False,
        )
    assert len(_ids_in(tmp_path)) == 8  # the third batch was in flight
    # A kill in the middle of a write leaves a torn line: the rerun repairs it.
    with (tmp_path / "math.jsonl").open("a") as f:
        f.write('{"id": "math/t9", "input_ids": [1, 2')
    resumed = ScriptedBackend()
    generate_dataset(prompts, resumed, tokenizer, tmp_path, Sampling(8), progress=False)
    assert len(resumed.asked) == 4
    assert sorted(_ids_in(tmp_path)) == sorted(p["id"] for p in prompts)


def test_rerun_with_other_settings_is_refused(tokenizer, tmp_path):
    prompts = _small_prompts(1)
    generate_dataset(
        prompts,
        ScriptedBackend(),
        tokenizer,
        tmp_path,
        Sampling(8),
        settings={"seed": 0},
        progress=False,
    )
    with pytest.raises(ValueError, match="other settings"):
        generate_dataset(
            prompts,
            ScriptedBackend(),
            tokenizer,
            tmp_path,
            Sampling(8, temperature=0.7),
            settings={"seed": 0},
            progress=False,
        )


def test_shards_are_what_the_trainer_reads(tokenizer, tmp_path):
    from sglang_dspark.drafter.training import data  # part of the package: never skipped

    generate_dataset(
        _small_prompts(2), ScriptedBackend(), tokenizer, tmp_path, Sampling(8), progress=False
    )
    seqs = data.load_sequences(tmp_path, max_length=4096)
    assert len(seqs) == 6
    assert all(int(s.loss_mask.sum()) == 4 for s in seqs)


# ---------------------------------------------------------------- sglang client
class _FakeSGLang(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply({"model_path": "/models/fake"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = req["input_ids"][-1]
        if last % 2:  # odd: stop token already trimmed by the server
            self._reply(
                {
                    "output_ids": [7, 8],
                    "meta_info": {"finish_reason": {"type": "stop", "matched": 2}},
                }
            )
        else:
            self._reply(
                {
                    "output_ids": [7] * req["sampling_params"]["max_new_tokens"],
                    "meta_info": {"finish_reason": {"type": "length", "length": 3}},
                }
            )


def test_sglang_backend_returns_exact_ids_with_the_stop_token():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = SGLangBackend(f"http://127.0.0.1:{server.server_port}", concurrency=3)
        assert backend.model == "/models/fake"
        prompts = [[5, 6, i] for i in range(10)]
        out = dict(backend.generate(prompts, Sampling(max_new_tokens=3)))
        assert sorted(out) == list(range(10))
        for i, c in out.items():
            if i % 2:
                assert c.output_ids == [7, 8, 2] and c.finish == "stop"
            else:
                assert c.output_ids == [7, 7, 7] and c.finish == "length"
    finally:
        server.shutdown()


def test_sglang_backend_says_when_no_server_answers():
    with pytest.raises(RuntimeError, match="no SGLang server"):
        SGLangBackend("http://127.0.0.1:9")


# ---------------------------------------------------------------- CLI
def test_cli_prompts_writes_all_domains(tmp_path):
    parser = argparse.ArgumentParser()
    data_cli.add_arguments(parser)
    out = tmp_path / "prompts.jsonl"
    args = parser.parse_args(["prompts", "--out", str(out), "--per-domain", "5", "--seed", "3"])
    assert data_cli.run(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["domain"] for r in rows[:3]] == list(DOMAINS)
    assert {d: sum(r["domain"] == d for r in rows) for d in DOMAINS} == dict.fromkeys(DOMAINS, 5)


def test_cli_build_with_hf_backend(tiny_target, tmp_path):
    parser = argparse.ArgumentParser()
    data_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "build",
            "--out",
            str(tmp_path),
            "--target",
            str(tiny_target),
            "--backend",
            "hf",
            "--per-domain",
            "2",
            "--max-new-tokens",
            "4",
            "--no-progress",
            "--dtype",
            "float32",
        ]
    )
    assert data_cli.run(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {d: s["sequences"] for d, s in summary["domains"].items()} == dict.fromkeys(DOMAINS, 2)
    assert summary["backend"] == "hf" and summary["sampling"]["mode"] == "greedy"
    assert summary["sources"]["code"]["stdlib"]["sha256"] == stdlib_manifest().sha256
    assert set(summary["dropped_eval_overlap"]) == set(DOMAINS)


def test_cli_build_answers_a_prompts_file(tiny_target, tmp_path):
    """`data build --prompts FILE`: the user's own prompts (the format `data prompts` writes),
    answered in file order per domain, eval overlaps dropped; bad files refused with the line."""
    gsm = json.loads(
        (Path(EvalGuard.from_dir().source) / "gsm8k.jsonl").read_text().splitlines()[0]
    )["turns"][0]
    rows = [
        {"id": "mine/0", "domain": "support", "messages": [{"role": "user", "content": "Reset my router?"}]},
        {"messages": [{"role": "user", "content": "Plan a three-day trip to Lisbon."}]},
        {"id": "mine/2", "domain": "support", "messages": [{"role": "user", "content": gsm}]},
        {"id": "mine/3", "domain": "support", "messages": [{"role": "user", "content": "Why is DNS slow?"}]},
    ]  # fmt: skip
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parser = argparse.ArgumentParser()
    data_cli.add_arguments(parser)
    out = tmp_path / "out"
    base = ["build", "--out", str(out), "--target", str(tiny_target), "--backend", "hf",
            "--max-new-tokens", "3", "--no-progress", "--dtype", "float32", "--device", "cpu"]  # fmt: skip
    assert data_cli.run(parser.parse_args([*base, "--prompts", str(prompts)])) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {d: s["sequences"] for d, s in summary["domains"].items()} == {"support": 2, "custom": 1}
    assert summary["dropped_eval_overlap"] == {"support": 1}
    assert summary["sources"]["prompts_file"] == "mine.jsonl"
    ids = [json.loads(line)["id"] for f in sorted(out.glob("*.jsonl")) for line in f.open()]
    assert sorted(ids) == ["mine/0", "mine/1", "mine/3"]  # unnamed rows: file stem / line

    prompts.write_text(json.dumps({"prompt": "no messages"}) + "\n")
    with pytest.raises(ValueError, match="line 1 has no 'messages'"):
        data_cli.run(parser.parse_args([*base, "--prompts", str(prompts)]))
    prompts.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        data_cli.run(parser.parse_args([*base, "--prompts", str(prompts)]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data_cli.run(parser.parse_args([*base, "--prompts", str(tmp_path / "none.jsonl")]))

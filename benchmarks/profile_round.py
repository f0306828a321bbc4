#!/usr/bin/env python3
"""What a decode round costs, term by term: py-spy on the embedded server's scheduler under load.

    python benchmarks/profile_round.py --arms mtp1,dspark-upstream,dspark --users 1,4,16 \
        --temperatures 1,0 --seconds 30 --repeats 2 --csv docs/data/round-cost.csv

For every repeat, arm by arm (one server at a time, the order rotated from repeat to repeat so a
shared machine's drift falls on every arm alike): one embedded server (`sglang-dspark embedded`'s
launch; `--arms` from `ARMS`: the DSPARK arms differ only in which of our round-cost hooks are
on), then for each temperature and concurrency a closed loop of `--users` clients (each sends
its next request as soon as the last one returns: packaged mt-bench prompts, `--max-tokens`
tokens, `ignore_eos`) for `--seconds`, while `py-spy record` samples the scheduler (50 Hz).

Per cell: ms per round (the scheduler's wall time over the verify rounds each client slot saw;
prefills included, as in serving), tokens per round per request, and each term's share of the
samples times the round (`TERMS`: draft pass and its LM head, Markov steps and confidence head,
the target's verify forward, accept). Prints one table (means over repeats, min-max beside them), writes every
cell as one CSV row (`--csv`). Needs `py-spy` (root, or ptrace allowed). Not a test: the ratios
between arms are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# arm -> (embedded arm, extra environment); "@N" stands for a draft-vocabulary file of the N
# most frequent response tokens of the in-tree training data, built on first use
ARMS = {
    "plain": ("plain", {}),
    "mtp1": ("mtp1", {}),
    # SGLang's own draft pass and accept (our round-cost hooks off)
    "dspark-upstream": (
        "dspark",
        {"SGLANG_DSPARK_DISABLE_HOOKS": "cpu_verified_rows_accept,cpu_draft_until_verifiable"},
    ),
    # the accept over verified rows only, SGLang's full draft pass
    "dspark-accept": ("dspark", {"SGLANG_DSPARK_DRAFT_EARLY_STOP": "0"}),
    # and the draft pass stopping where nothing more is verified, over the full vocabulary
    "dspark-stop": ("dspark", {"SGLANG_DSPARK_DRAFT_VOCAB": "full"}),
    **{
        f"dspark-vocab{n}": ("dspark", {"SGLANG_DSPARK_DRAFT_VOCAB": f"@{n}"})
        for n in (8192, 16384, 32768)
    },
    "dspark": ("dspark", {}),  # the shipped default
}
TRAIN_DATA = Path(__file__).resolve().parents[1] / "recipes/data/smollm2-regen-t07"


def resolve_vocab(env: dict, target, out_dir: Path) -> dict:
    """`env` with an "@N" draft vocabulary replaced by the file (made once in `out_dir`)."""
    value = env.get("SGLANG_DSPARK_DRAFT_VOCAB", "")
    if not value.startswith("@"):
        return env
    from transformers import AutoConfig, AutoTokenizer

    from sglang_dspark.drafter.formats import draft_vocab
    from sglang_dspark.drafter.training.data import load_sequences

    path = out_dir / f"draft-vocab-{value[1:]}.safetensors"
    if not path.is_file():
        vocab = int(AutoConfig.from_pretrained(target).vocab_size)
        counts = draft_vocab.token_counts(load_sequences(TRAIN_DATA, max_length=4096), vocab)
        special = AutoTokenizer.from_pretrained(target).all_special_ids
        ids = draft_vocab.top_tokens(counts, int(value[1:]), [t for t in special if t < vocab])
        draft_vocab.save_draft_vocab(path, ids, vocab)
    return {**env, "SGLANG_DSPARK_DRAFT_VOCAB": str(path)}


# term -> substrings of py-spy frames ("Class.function (path/file.py:line)"); a sample counts
# for a term when any frame of its stack matches
TERMS = {
    "draft": [
        "DraftBlockProposer.propose (",
        "_propose (sglang_dspark/plugin/cpu_draft.py",
        "EagleDraftWorker.draft (",
        "EagleDraftWorker._draft_extend_for_decode (",
    ],
    "draft_forward": ["DraftBlockProposer._run_forward (", "EagleDraftWorker.draft_forward ("],
    "lm_head": ["compute_base_logits (", "subset_base_logits ("],
    "markov": ["_draft_step (", "subset_step ("],
    "confidence": ["compute_confidence ("],
    "verify": [
        "TargetVerifyExecutor.run_compact (",
        "TargetVerifyExecutor.run_non_compact (",
        "EAGLEWorkerV2.verify (",
    ],
    "accept": [
        "TargetVerifyExecutor.accept_and_finalize (",
        "tree_speculative_sampling_target_only",
        "verify_tree_greedy",
    ],
}


def busiest_child(pid: int) -> int:
    """The process under `pid` (itself included) with the most CPU time: the scheduler."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return max(procs, key=lambda p: sum(p.cpu_times()[:2])).pid


def frame_shares(raw: Path) -> tuple[collections.Counter, int]:
    """Inclusive sample count per frame ("function (file)") from py-spy's collapsed stacks."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        total += int(n)
        names = set()
        for frame in stack.split(";"):
            func, _, where = frame.partition(" (")
            names.add(f"{func} ({where.split(':')[0].rsplit('/', 1)[-1]}")
        for name in names:
            counts[name] += int(n)
    return counts, total


def term_shares(raw: Path) -> tuple[dict[str, int], collections.Counter, int]:
    """Samples per term (`TERMS`), inclusive samples per frame, and the total."""
    terms = dict.fromkeys(TERMS, 0)
    counts, total = frame_shares(raw)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        hit = {term for term, keys in TERMS.items() if any(k in stack for k in keys)}
        if "accept" in hit:  # MTP-1's accept runs inside its verify(): the target forward apart
            hit.discard("verify")
        for term in hit:
            terms[term] += int(n)
    return terms, counts, total


def closed_loop(base_url, prompts, users, seconds, max_tokens, temperature) -> dict:
    """`users` clients, each sending its next request when the last returns, for `seconds`."""
    from sglang_dspark.serving.client import generate_ids

    stop = time.perf_counter() + seconds
    stats = {"tokens": 0, "rounds": 0, "requests": 0}
    lock = threading.Lock()

    def client(i: int) -> None:
        k = i
        while time.perf_counter() < stop:
            out = generate_ids(base_url, prompts[k % len(prompts)], max_new_tokens=max_tokens,
                               temperature=temperature, ignore_eos=True)  # fmt: skip
            k += users
            with lock:
                stats["tokens"] += len(out["output_ids"])
                stats["rounds"] += out["meta_info"].get("spec_verify_ct", 0)
                stats["requests"] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats["seconds"] = time.perf_counter() - t0
    return stats


def profile_cell(server, spy, prompts, *, arm, users, temperature, seconds, max_tokens, raw):
    done = {}
    worker = threading.Thread(target=lambda: done.update(closed_loop(
        server.base_url, prompts, users, seconds, max_tokens, temperature)), daemon=True)  # fmt: skip
    worker.start()
    time.sleep(2)
    pid = busiest_child(server.proc.pid)
    subprocess.run(
        [spy, "record", "--pid", str(pid), "--rate", "50", "--nonblocking", "--duration",
         str(max(int(seconds) - 4, 1)), "--format", "raw", "--output", str(raw)],
        check=True, capture_output=True,
    )  # fmt: skip
    worker.join()
    steps = done["rounds"] if arm != "plain" else done["tokens"]
    ms = 1000.0 * done["seconds"] * users / max(steps, 1)
    terms, counts, total = term_shares(raw)
    row = {"arm": arm, "users": users, "temperature": temperature, "requests": done["requests"],
           "rounds": steps, "seconds": round(done["seconds"], 2), "ms_round": round(ms, 2),
           "tokens_per_round": round(done["tokens"] / max(steps, 1), 3)}  # fmt: skip
    for term, n in terms.items():
        row[f"ms_{term}"] = round(ms * n / max(total, 1), 2)
    return row, counts, total, ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--arms", default="mtp1,dspark-upstream,dspark")
    parser.add_argument("--users", default="4", help="comma-separated concurrencies")
    parser.add_argument("--temperatures", default="1", help="comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0, help="per cell")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--top", type=int, default=0, help="also print the top frames per cell")
    parser.add_argument("--csv", type=Path, default=None, help="one row per cell and repeat")
    parser.add_argument("--out", type=Path, default=None, help="keep the raw stacks here")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    users = [int(u) for u in args.users.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        parser.error("py-spy is not installed: pip install py-spy")

    from transformers import AutoTokenizer

    from sglang_dspark.evaluation.benchmarks import default_eval_dir, load_prompts
    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.client import chat_prompt_ids, generate_many
    from sglang_dspark.serving.server import SGLangServer, free_port

    paths = embedded.ensure(dtype="bfloat16")
    tok = AutoTokenizer.from_pretrained(paths.target)
    prompts = [chat_prompt_ids(tok, t) for t in load_prompts(default_eval_dir(), "mt-bench")]
    stacks = args.out or Path(tempfile.mkdtemp(prefix="profile-round-"))
    stacks.mkdir(parents=True, exist_ok=True)
    rows = []
    for rep in range(args.repeats):
        order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
        for arm in order:
            kind, env = ARMS[arm]
            env = resolve_vocab(env, paths.target, stacks)
            port = free_port()
            cmd = embedded.launch_command(paths, port=port, speculative=kind != "plain",
                                          arm="dspark" if kind == "plain" else kind)  # fmt: skip
            log = stacks / f"server-{arm}-{rep}.log"
            with SGLangServer(cmd, embedded.launch_env({**os.environ, **env}),
                              port, log) as server:  # fmt: skip
                generate_many(server.base_url, prompts[:1], max_new_tokens=8)  # warm-up
                for t in temps:
                    for u in users:
                        raw = stacks / f"{arm}-u{u}-t{t:g}-r{rep}.txt"
                        row, counts, total, ms = profile_cell(
                            server, spy, prompts, arm=arm, users=u, temperature=t,
                            seconds=args.seconds, max_tokens=args.max_tokens, raw=raw)  # fmt: skip
                        row["repeat"] = rep
                        rows.append(row)
                        print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
                        top = [(n, c) for n, c in counts.most_common() if c < 0.97 * total]
                        for name, c in top[: args.top]:
                            print(f"  {c / total:6.1%} {ms * c / total:7.1f} ms  {name}")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(summary_table(rows))
    print(f"raw stacks and server logs: {stacks}")
    return 0


def summary_table(rows: list[dict]) -> str:
    """Markdown: per arm, temperature and users, the mean over repeats (min-max of ms a round)."""
    cells: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in rows:
        cells[(r["temperature"], r["users"], r["arm"])].append(r)
    keys = ["ms_round", "tokens_per_round", *[f"ms_{t}" for t in TERMS]]
    out = ["| T | users | arm | n | " + " | ".join(keys) + " |",
           "| --- " * (4 + len(keys)) + "|"]  # fmt: skip
    for (t, u, arm), rs in sorted(cells.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        vals = []
        for k in keys:
            xs = [float(r[k]) for r in rs]
            mean = sum(xs) / len(xs)
            vals.append(f"{mean:.1f} ({min(xs):.0f}-{max(xs):.0f})" if k == "ms_round" and
                        len(xs) > 1 else (f"{mean:.2f}" if k == "tokens_per_round" else
                                          f"{mean:.1f}"))  # fmt: skip
        out.append(f"| {t:g} | {u} | {arm} | {len(rs)} | " + " | ".join(vals) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

"""`sglang-dspark demo`: the embedded default end to end.

Prepares SmolLM2 and its drafter, starts `python -m sglang.launch_server --speculative-algorithm
DSPARK ...` on 127.0.0.1, sends one chat request through the OpenAI API, prints the answer and
the server's speculative statistics, and stops the server (`--keep-serving` leaves it up).
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
import time
from pathlib import Path

import requests

EXAMPLE = "Write a Python function that returns the n-th Fibonacci number."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompt", default=EXAMPLE)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--keep-serving", action="store_true", help="leave the server running")


def run(args: argparse.Namespace) -> int:
    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.server import SGLangServer

    paths = embedded.ensure(dtype=args.dtype)
    kind = "trained (shipped)" if paths.draft_is_trained else "random (placeholder)"
    cmd = embedded.launch_command(paths, port=args.port, dtype=args.dtype)
    print(f"target: {paths.target}\ndraft:  {paths.draft} [{kind}]")
    print("launch: " + shlex.join(cmd))
    log = Path(tempfile.gettempdir()) / f"sglang-dspark-demo-{args.port}.log"
    server = SGLangServer(cmd=cmd, env=embedded.launch_env(), port=args.port, log_path=log)
    print(f"starting SGLang (about a minute on 2 cores; log: {log}) ...", flush=True)
    server.start()
    try:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        t0 = time.perf_counter()
        reply = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()
        elapsed = time.perf_counter() - t0
        out = reply.json()
        tokens = out["usage"]["completion_tokens"]
        print(f"\nuser: {args.prompt}\nassistant: {out['choices'][0]['message']['content']}\n")
        print(f"{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s)")
        accept = [line for line in server.log_text().splitlines() if "accept len" in line]
        if accept:
            print("server: " + accept[-1].split("] ", 1)[-1])
        if args.keep_serving:
            print(f"\nserving on {server.base_url} (Ctrl-C stops it)")
            server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0

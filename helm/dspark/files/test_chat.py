"""helm test: one chat completion through the API endpoint; the answer must match EXPECT."""

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

API = os.environ["API_URL"].rstrip("/")
PROMPT = os.environ["PROMPT"]
EXPECT = os.environ["EXPECT"]
MAX_TOKENS = int(os.environ["MAX_TOKENS"])
# Extra request fields, e.g. {"chat_template_kwargs": {"enable_thinking": false}}.
EXTRA_BODY = json.loads(os.environ.get("EXTRA_BODY") or "{}")
DEADLINE = time.monotonic() + float(os.environ["TIMEOUT_SECONDS"])
# The router's API key (router.apiKey), from its Secret; empty: none.
API_KEY = os.environ.get("API_KEY", "")


def call(path, payload=None):
    """GET (or POST JSON) with retries on connection errors and 5xx until the deadline."""
    data = None if payload is None else json.dumps(payload).encode()
    while True:
        headers = {"Content-Type": "application/json"}
        if API_KEY:
            headers["Authorization"] = f"Bearer {API_KEY}"
        request = urllib.request.Request(API + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return json.load(resp)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            status = getattr(err, "code", None)
            if status is not None and status < 500 or time.monotonic() > DEADLINE:
                sys.exit(f"FAIL: {path}: {err}")
            print(f"waiting for {API}{path}: {err}", flush=True)
            time.sleep(5)


model = call("/v1/models")["data"][0]["id"]
reply = call(
    "/v1/chat/completions",
    {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **EXTRA_BODY,
    },
)
answer = reply["choices"][0]["message"]["content"] or ""
tokens = reply.get("usage", {}).get("completion_tokens", 0)
print(f"model={model} completion_tokens={tokens} answer={answer!r}")
if tokens < 1 or not answer.strip():
    sys.exit("FAIL: empty answer")
if not re.search(EXPECT, answer, re.IGNORECASE):
    sys.exit(f"FAIL: answer does not match {EXPECT!r}")
print("PASS")

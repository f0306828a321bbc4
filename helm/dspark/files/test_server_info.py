"""helm test: /server_info of a server shows the configured speculative decoding settings."""

import json
import os
import sys
import time
import urllib.error
import urllib.request

URL = os.environ["SERVER_URL"].rstrip("/") + "/server_info"
DEADLINE = time.monotonic() + float(os.environ["TIMEOUT_SECONDS"])
# Accepted names: SGLang resolves NEXTN to EAGLE.
EXPECT_ALGORITHMS = set(os.environ["EXPECT_ALGORITHMS"].split(","))
EXPECT = {  # field -> expected value; empty env = not checked
    "speculative_num_draft_tokens": os.environ.get("EXPECT_NUM_DRAFT_TOKENS", ""),
    "speculative_num_steps": os.environ.get("EXPECT_NUM_STEPS", ""),
    "speculative_dspark_sps_table_path": os.environ.get("EXPECT_SPS_PATH", ""),
    "speculative_dspark_confidence_sts_path": os.environ.get("EXPECT_STS_PATH", ""),
}


def find(obj, key):
    """First value of `key` anywhere in nested dicts / lists (None when absent)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        children = obj.values()
    elif isinstance(obj, list):
        children = obj
    else:
        return None
    for child in children:
        found = find(child, key)
        if found is not None:
            return found
    return None


while True:
    try:
        with urllib.request.urlopen(URL, timeout=60) as resp:
            info = json.load(resp)
        break
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        if time.monotonic() > DEADLINE:
            sys.exit(f"FAIL: {URL}: {err}")
        print(f"waiting for {URL}: {err}", flush=True)
        time.sleep(5)

algorithm = str(find(info, "speculative_algorithm"))
print(f"speculative_algorithm={algorithm}")
failures = []
if algorithm not in EXPECT_ALGORITHMS:
    failures.append(
        f"speculative_algorithm is {algorithm}, expected one of {sorted(EXPECT_ALGORITHMS)}"
    )
for field, expected in EXPECT.items():
    if expected:
        actual = find(info, field)
        print(f"{field}={actual}")
        if str(actual) != expected:
            failures.append(f"{field} is {actual}, expected {expected}")
if failures:
    sys.exit("FAIL: " + "; ".join(failures))
print("PASS")

"""Wait until every arm of a load-test run is ready to be measured (standard library only).

Input: env DSPARK_ARMS, a JSON list of {"label", "release", "url"}; NAMESPACE; TIMEOUT_SECONDS;
SLA_API_KEY (optional, sent as a bearer token). An arm is ready when

- every server workload of its release (StatefulSets and LeaderWorkerSets labelled
  app.kubernetes.io/instance=<release>, app.kubernetes.io/component=server) has all its
  replicas Ready at its current generation (through the Kubernetes API, with the pod's service
  account: get/list on those two kinds in this namespace), and
- its URL answers GET /v1/models with 200.

A workload still rolling out, or scaled by an autoscaler that has not caught up, is not ready:
a sweep must not start while the fleet changes under it. Exit 0 when all arms are ready,
1 at the deadline (the reasons are printed).
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
API = "https://kubernetes.default.svc"
KINDS = {
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets",
    "LeaderWorkerSet": "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets",
}


def _kube_get(path: str, query: dict[str, str]) -> dict | None:
    """GET from the Kubernetes API; None when the kind is not installed (404)."""
    with open(f"{SA}/token") as f:
        token = f.read().strip()
    request = urllib.request.Request(
        API + path + "?" + urllib.parse.urlencode(query),
        headers={"Authorization": f"Bearer {token}"},
    )
    context = ssl.create_default_context(cafile=f"{SA}/ca.crt")
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise


def workload_problems(release: str, namespace: str, get=_kube_get) -> list[str]:
    """Why the release's server workloads are not all Ready ([] when they are)."""
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=server"
    found, problems = 0, []
    for kind, path in KINDS.items():
        listing = get(path.format(ns=namespace), {"labelSelector": selector})
        for item in (listing or {}).get("items", []):
            found += 1
            name = item["metadata"]["name"]
            want = item.get("spec", {}).get("replicas", 1)
            status = item.get("status", {})
            ready = status.get("readyReplicas", 0)
            updated = status.get("updatedReplicas", want)
            generation = item["metadata"].get("generation", 0)
            observed = status.get("observedGeneration", generation)
            if observed < generation or ready < want or updated < want:
                problems.append(
                    f"{kind} {name}: {ready}/{want} ready, {updated}/{want} updated, "
                    f"generation {observed}/{generation}"
                )
    if not found:
        problems.append(f"no server StatefulSet or LeaderWorkerSet of release {release!r}")
    return problems


def url_problem(url: str, api_key: str) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url.rstrip("/") + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return None if resp.status == 200 else f"{url}/v1/models: HTTP {resp.status}"
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        return f"{url}/v1/models: {err}"


def main() -> int:
    arms = json.loads(os.environ["DSPARK_ARMS"])
    namespace = os.environ["NAMESPACE"]
    api_key = os.environ.get("SLA_API_KEY", "")
    deadline = time.monotonic() + float(os.environ["TIMEOUT_SECONDS"])
    while True:
        problems = []
        for arm in arms:
            if arm.get("release"):
                problems += [
                    f"{arm['label']}: {p}" for p in workload_problems(arm["release"], namespace)
                ]
            if (p := url_problem(arm["url"], api_key)) is not None:
                problems.append(f"{arm['label']}: {p}")
        if not problems:
            print("ready:", ", ".join(f"{a['label']} ({a['url']})" for a in arms), flush=True)
            return 0
        if time.monotonic() > deadline:
            print("not ready at the deadline:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print("waiting: " + "; ".join(problems), flush=True)
        time.sleep(15)


if __name__ == "__main__":
    sys.exit(main())

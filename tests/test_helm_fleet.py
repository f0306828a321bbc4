"""The dspark chart as a production fleet: what a platform team needs beyond one server.

Each section is one item of the chart's fleet work, tested on the rendered manifests (rendered
once per set of values, see test_helm.render): multi-node DeepSeek-V4 on a LeaderWorkerSet and
its MTP-1 baseline; models fetched once per cluster, pinned, mounted read-only, and caches that
survive restarts; autoscaling (HPA with its prometheus-adapter rules, or KEDA); the A/B
comparison (dashboard per release, the comparison Job, its report); the router (gateway image
and pin, API key, Ingress, coherent cache-aware routing); hardening (read-only root, PDBs);
prefill/decode disaggregation (off by default; its two roles, their wiring and the refusals).
LeaderWorkerSet and ScaledObject are checked against their CRDs' own schemas (vendored in
tests/helm_fixtures with their source and version), SGLang flags with SGLang's own parser.

    python -m pytest tests/test_helm_fleet.py -m helm
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from test_helm import (
    CHART,
    CRD_SCHEMAS,
    FULL,
    GPU_PROFILES,
    MULTINODE,
    NS,
    PD,
    PROFILES,
    RELEASE,
    REPO,
    V4_PROFILES,
    _package_dir,
    _run_sweep,
    all_containers,
    container,
    env_of,
    fake_server,  # noqa: F401  (fixture)
    find,
    loadtest_pod,
    parse_args,
    pd_role_templates,
    pod_templates,
    render,
    render_overlay,
    server_pod,
    template,
    values_file,
)

pytestmark = pytest.mark.helm

FILES = CHART / "files"
# Substituted for $(VAR) in container args as the kubelet does: LWS's webhook puts these in
# the environment of every pod of a group (leader: worker index 0).
LWS_ENV = {
    "leader": {"LWS_LEADER_ADDRESS": "v4-server-lws-0.v4-server-lws.llm", "LWS_WORKER_INDEX": "0"},
    "worker": {"LWS_LEADER_ADDRESS": "v4-server-lws-0.v4-server-lws.llm", "LWS_WORKER_INDEX": "1"},
}


def multinode(profile: str, *more) -> list[dict]:
    return render(PROFILES[profile], MULTINODE, *more)


def lws(docs: list[dict]) -> dict:
    return find(docs, "LeaderWorkerSet")


def role_template(docs: list[dict], role: str) -> dict:
    return lws(docs)["spec"]["leaderWorkerTemplate"][f"{role}Template"]


def expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def fails(tmp_path: Path, values: dict, *base: Path) -> str:
    result = template(*base, values_file(tmp_path, values))
    assert result.returncode != 0, "rendered although it should not"
    return result.stderr


# --------------------------------------------------------------------------------------------
# CRD schemas (vendored) and SGLang's own parser


def _closed(schema):
    """A copy where every object that lists properties rejects others (the API server would
    prune them silently; a misspelt field is a bug in the chart)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    doc = json.loads(CRD_SCHEMAS[(api_version, kind)].read_text())
    schema = _closed(copy.deepcopy(doc["schema"]))
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def validate_crd(doc: dict) -> None:
    import jsonschema

    jsonschema.validate(doc, crd_schema(doc["apiVersion"], doc["kind"]))


def test_vendored_crd_schemas_name_their_source():
    for (api_version, kind), path in CRD_SCHEMAS.items():
        if kind == "ServiceMonitor":
            continue
        doc = json.loads(path.read_text())
        src = doc["source"]
        assert f"{src['group']}/{src['version']}" == api_version and src["kind"] == kind
        assert re.fullmatch(r"v\d+\.\d+\.\d+", src["tag"]) and re.fullmatch(
            r"[0-9a-f]{40}", src["commit"]
        )
        assert src["tag"] in doc["$comment"] and src["commit"] in doc["$comment"]


def test_crd_schemas_reject_misspelt_fields():
    import jsonschema

    docs = multinode("deepseek-v4-flash-dspark")
    bad = copy.deepcopy(lws(docs))
    bad["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(bad)
    bad = copy.deepcopy(lws(docs))
    bad["spec"]["startupPolicy"] = "WhenReady"  # not in the CRD's enum
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(bad)


@functools.cache
def sglang_parse(argvs: tuple[tuple[str, ...], ...]) -> list[dict]:
    """Parse each argv with SGLang 0.5.23's own server parser (ServerArgs.add_cli_args), in one
    subprocess; the parsed values of the flags the chart sets."""
    code = textwrap.dedent(
        """
        import argparse, json, sys
        from sglang.srt.server_args import ServerArgs
        out = []
        for argv in json.load(sys.stdin):
            parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
            ServerArgs.add_cli_args(parser)
            ns = vars(parser.parse_args(argv))
            out.append({k: v for k, v in ns.items() if isinstance(v, (str, int, float, bool))})
        print(json.dumps(out))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _every_server_argv() -> dict[str, tuple[str, ...]]:
    argvs = {}
    renders = {p: (PROFILES[p], FULL) for p in PROFILES}
    renders |= {f"{p}+2x8": (PROFILES[p], MULTINODE, FULL) for p in V4_PROFILES}
    renders |= {f"{p}+pd": (PROFILES[p], FULL, PD) for p in GPU_PROFILES}
    for name, files in renders.items():
        for doc in render(*files):
            if doc["kind"] not in ("StatefulSet", "LeaderWorkerSet"):
                continue
            for role, tmpl in zip(("leader", "worker"), pod_templates(doc), strict=False):
                env = LWS_ENV[role] if doc["kind"] == "LeaderWorkerSet" else {}
                args = [expand(a, env) for a in container(tmpl, "sglang")["args"]]
                pd = tmpl["metadata"]["labels"].get("dspark.io/pd-role")
                argvs[f"{name}/{role if env else pd or 'pod'}"] = tuple(args)
    return argvs


def test_every_rendered_server_command_parses_with_sglangs_parser():
    argvs = _every_server_argv()
    assert len(argvs) == len(PROFILES) + 2 * len(V4_PROFILES) + 2 * len(GPU_PROFILES)
    parsed = dict(zip(argvs, sglang_parse(tuple(argvs.values())), strict=True))
    for name, ns in parsed.items():
        args = parse_args(list(argvs[name]))
        # what the chart meant is what SGLang read
        assert ns["model_path"] == args["--model-path"][0], name
        assert ns["tp_size"] == int(args["--tp-size"][0]), name
        if "--speculative-algorithm" in args:
            assert ns["speculative_algorithm"] == args["--speculative-algorithm"][0], name
    for profile in V4_PROFILES:
        leader, worker = parsed[f"{profile}+2x8/leader"], parsed[f"{profile}+2x8/worker"]
        assert (leader["nnodes"], leader["node_rank"], worker["node_rank"]) == (2, 0, 1)
        assert (
            leader["dist_init_addr"]
            == worker["dist_init_addr"]
            == ("v4-server-lws-0.v4-server-lws.llm:20000")
        )
        assert (leader["tp_size"], leader["attn_dp_size"], leader["ep_size"]) == (16, 16, 16)
        assert leader["enable_dp_lm_head"] is True and leader["moe_a2a_backend"] == "none"
    default_bootstrap = yaml.safe_load((CHART / "values.yaml").read_text())["server"][
        "disaggregation"
    ]["bootstrapPort"]
    for profile in GPU_PROFILES:
        prefill, decode = parsed[f"{profile}+pd/prefill"], parsed[f"{profile}+pd/decode"]
        assert (prefill["disaggregation_mode"], decode["disaggregation_mode"]) == (
            "prefill",
            "decode",
        )
        for ns in (prefill, decode):
            assert ns["disaggregation_transfer_backend"] == "mooncake", profile
            assert ns["disaggregation_ib_device"] == "mlx5_0,mlx5_1", profile
        # the chart's default is SGLang's (decode takes the prefill's from each request)
        assert prefill["disaggregation_bootstrap_port"] == 8998 == default_bootstrap
        assert decode["disaggregation_bootstrap_port"] == 8998
        assert prefill["chunked_prefill_size"] == 8192  # pd.yaml's per-role extra args
        assert decode["disaggregation_decode_polling_interval"] == 2
        # both roles run the same model and speculative decoding
        same = ("model_path", "tp_size", "speculative_algorithm", "dtype")
        assert [prefill.get(k) for k in same] == [decode.get(k) for k in same], profile
        assert parsed[f"{profile}/pod"]["disaggregation_mode"] == "null"


# --------------------------------------------------------------------------------------------
# 1. multi-node DeepSeek-V4 (LeaderWorkerSet), DP attention / EP, the V4 MTP-1 baseline


@pytest.mark.parametrize("profile", V4_PROFILES)
def test_multinode_v4_is_a_leaderworkerset_group_of_two_nodes(profile):
    docs = multinode(profile)
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    group = lws(docs)
    validate_crd(group)
    lwt = group["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert group["metadata"]["name"] == "dspark-server-lws"  # not the chart's Service name
    for role in ("leader", "worker"):
        tmpl = role_template(docs, role)
        assert tmpl["metadata"]["labels"]["dspark.io/role"] == role
        sglang = container(tmpl, "sglang")
        args = parse_args(sglang["args"])
        assert args["--nnodes"] == ["2"]
        assert args["--node-rank"] == ["$(LWS_WORKER_INDEX)"]
        assert args["--dist-init-addr"] == ["$(LWS_LEADER_ADDRESS):20000"]
        # 8 GPUs per node, TP 16 across both
        assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert args["--tp-size"] == ["16"]
        assert args["--attn-dp-size"] == ["16"] and args["--ep-size"] == ["16"]
    leader_ports = {
        p["name"]: p["containerPort"]
        for p in container(role_template(docs, "leader"), "sglang")["ports"]
    }
    assert leader_ports["dist-init"] == 20000
    # workers serve no API: they are ready when SGLang's /health on them answers
    worker = container(role_template(docs, "worker"), "sglang")
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # one cache claim per pod (leader and workers)
    assert [c["metadata"]["name"] for c in lwt["volumeClaimTemplates"]] == ["cache"]


def test_only_group_leaders_receive_traffic():
    docs = multinode("deepseek-v4-flash-dspark")
    leader = role_template(docs, "leader")["metadata"]["labels"]
    worker = role_template(docs, "worker")["metadata"]["labels"]
    router = parse_args(container(find(docs, "Deployment")["spec"]["template"], "router")["args"])
    selector = dict(item.split("=", 1) for item in router["--selector"])
    assert selector.items() <= leader.items() and not selector.items() <= worker.items()
    api = find(docs, "Service", "dspark-server")["spec"]["selector"]
    assert api.items() <= leader.items() and not api.items() <= worker.items()
    # the headless Service (ServiceMonitor endpoints) covers every pod, workers included
    headless = find(docs, "Service", "dspark-server-headless")["spec"]["selector"]
    assert headless.items() <= leader.items() and headless.items() <= worker.items()


def test_static_router_list_names_the_group_leaders(tmp_path):
    docs = render_overlay(
        tmp_path,
        {"router": {"discovery": "static"}, "server": {"replicas": 2}},
        PROFILES["deepseek-v4-flash-dspark"],
        MULTINODE,
    )
    router = parse_args(container(find(docs, "Deployment")["spec"]["template"], "router")["args"])
    # LWS names leaders <lws>-<i> under its own headless Service <lws>
    assert router["--worker-urls"] == [
        f"http://dspark-server-lws-{i}.dspark-server-lws.{NS}.svc:30000" for i in range(2)
    ]


def test_network_policy_lets_a_group_talk_to_itself():
    docs = multinode("deepseek-v4-flash-dspark", FULL)
    server_np = find(docs, "NetworkPolicy", "dspark-server")
    group = [r for r in server_np["spec"]["ingress"] if "ports" not in r]
    (rule,) = group  # every port (rendezvous, NCCL), only from this release's server pods
    (peer,) = rule["from"]
    labels = role_template(docs, "worker")["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    assert not [
        r
        for r in find(docs, "NetworkPolicy", "dspark-server")["spec"]["ingress"]
        if "ports" not in r and r is not rule
    ]
    single = find(
        render(PROFILES["deepseek-v4-flash-dspark"], FULL), "NetworkPolicy", "dspark-server"
    )
    assert all("ports" in r for r in single["spec"]["ingress"])


@pytest.mark.parametrize(
    "values, words",
    [
        ({"server": {"enableDpLmHead": False}}, "needs server.enableDpLmHead=true"),
        (
            {"server": {"moeA2aBackend": "deepep"}},
            "supports server.moeA2aBackend none, megamoe or mori",
        ),
        (
            {"server": {"moeA2aBackend": "megamoe"}},
            "needs speculative.dspark.raggedVerifyMode=static",
        ),
        ({"server": {"gpus": 4}}, "must equal server.gpus (4 per node) x multiNode.nodes (2)"),
        ({"server": {"attnDpSize": 3}}, "server.attnDpSize (3) must divide server.tpSize (16)"),
        ({"server": {"device": "cpu"}}, "server.multiNode needs GPUs"),
    ],
)
def test_chart_refuses_what_sglang_0_5_23_refuses(tmp_path, values, words):
    err = fails(tmp_path, values, PROFILES["deepseek-v4-flash-dspark"], MULTINODE)
    assert words in err, err


def test_the_same_layout_is_fine_for_the_mtp1_baseline(tmp_path):
    # the DSpark-only rules (dp-lm-head, a2a backend) do not bind EAGLE
    docs = render_overlay(
        tmp_path,
        {"server": {"enableDpLmHead": False}},
        PROFILES["deepseek-v4-flash-mtp1-baseline"],
        MULTINODE,
    )
    assert "--enable-dp-lm-head" not in parse_args(
        container(role_template(docs, "leader"), "sglang")["args"]
    )


def test_v4_mtp1_baseline_serves_nextn_as_eagle_top1():
    docs = render(PROFILES["deepseek-v4-flash-mtp1-baseline"])
    args = parse_args(container(server_pod(docs), "sglang")["args"])
    # SGLang 0.5.23 allows EAGLE (topk 1) and DSPARK for DeepSeek-V4; NextN is in the checkpoint
    assert args["--speculative-algorithm"] == ["EAGLE"]
    assert (args["--speculative-num-steps"], args["--speculative-eagle-topk"]) == (["1"], ["1"])
    assert args["--speculative-num-draft-tokens"] == ["2"]
    assert "--speculative-draft-model-path" not in args
    info = env_of(find(docs, "Pod", "dspark-test-server-info")["spec"]["containers"][0])
    assert info["EXPECT_ALGORITHMS"]["value"] == "EAGLE"


def test_what_the_chart_assumes_of_sglang_0_5_23_is_in_its_source():
    """The V4 MTP-1 profile, the DP-attention rules and the README's PD section rest on these
    lines of the installed SGLang; a new SGLang that changes them fails here first."""
    hooks = _package_dir("sglang") / "srt" / "arg_groups"
    v4 = (hooks / "deepseek_v4_hook.py").read_text()
    spec = (hooks / "speculative_hook.py").read_text()
    # EAGLE (top-1) and DSPARK are the algorithms SGLang serves DeepSeek-V4 with
    assert re.search(r'cfg\.speculative_algorithm in \(\s*"EAGLE",\s*"DSPARK",\s*\)', v4)
    assert "Only EAGLE speculative algorithm with topk == 1 is supported" in v4
    # its NextN draft defaults to the target checkpoint
    eagle = spec.split("def _handle_eagle_family", 1)[1]
    assert (
        '"DeepseekV4ForCausalLM"'
        in eagle.split("speculative_draft_model_path=cfg.model_path", 1)[0]
    )
    # DSpark with DP attention
    assert "DSpark with dp attention requires --enable-dp-lm-head." in spec
    assert 'moe_a2a_backend not in ("none", "megamoe", "mori")' in spec
    assert "DSpark DP MoE or prefill coordination requires" in spec
    # DSpark PD: SGLang's only DSpark-specific PD rule is DeepSeek-V4.1's (static verify,
    # Mooncake or NIXL); validate_deepseek_v41_features returns before it for any other model
    # type (DeepSeek-V4-Flash, Qwen3)
    v41 = v4.split("def validate_deepseek_v41_features", 1)[1].split("\ndef ", 1)[0]
    early = re.search(
        r'if model_config_of\(server_args\)\.hf_config\.model_type != "deepseek_v41":\n'
        r"(?:\s+.*\n){0,5}?\s+return\n",
        v41,
    )
    assert early and v41.index(early.group(0)) < v41.index("DSpark PD requires static verify")
    assert "DeepSeek-V4.1 DSpark PD requires static verify, Mooncake or NIXL" in v41
    assert "read_ragged_verify_mode() is not RaggedVerifyMode.STATIC" in v41
    # the transfer backends the chart renders are SGLang's choices
    choices = (hooks / "choices.py").read_text()
    backends = re.search(r"DISAGG_TRANSFER_BACKEND_CHOICES = \[(.*?)\]", choices, re.DOTALL)
    assert {"mooncake", "nixl"} <= set(re.findall(r'"([a-z_]+)"', backends.group(1)))
    # a PD prefill server cannot use the fake backend
    pd_hook = (hooks / "pd_disaggregation_hook.py").read_text()
    assert "Prefill server does not support 'fake' as the transfer backend" in pd_hook


# --------------------------------------------------------------------------------------------
# 2. models once per cluster, pinned, read-only; ephemeral storage; persistent caches


@pytest.mark.parametrize("profile", ["qwen3-8b-dspark", "deepseek-v4-flash-dspark"])
def test_prefetch_job_fills_one_volume_that_servers_mount_read_only(profile):
    docs = render(PROFILES[profile])
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "models"
    jpod = job["spec"]["template"]
    download = container(jpod, "download-models")
    assert download["command"] == ["python3", "/opt/dspark/scripts/download_models.py"]
    claim = {v["name"]: v for v in jpod["spec"]["volumes"]}["models"]["persistentVolumeClaim"]
    assert "readOnly" not in claim  # the Job alone writes
    pod = server_pod(docs)
    wait = container(pod, "wait-for-models")
    assert wait["command"][-1] == "--wait"
    assert env_of(wait)["DSPARK_MODELS"] == env_of(download)["DSPARK_MODELS"]
    svolume = {v["name"]: v for v in pod["spec"]["volumes"]}["models"]["persistentVolumeClaim"]
    assert svolume == {"claimName": claim["claimName"], "readOnly": True}
    assert {m["name"]: m for m in wait["volumeMounts"]}["models"]["readOnly"] is True
    if profile == "qwen3-8b-dspark":  # the chart's own claim: ReadWriteMany, kept
        pvc = find(docs, "PersistentVolumeClaim", claim["claimName"])
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_prefetch_job_is_renamed_whenever_its_immutable_pod_template_changes(tmp_path):
    """Kubernetes refuses any change to a Job's spec.template, so `helm upgrade` fails unless a
    changed template comes with a new Job name: same name must mean the same template."""
    base = PROFILES["qwen3-8b-dspark"]

    def job(values):
        docs = render_overlay(tmp_path, values, base)
        (j,) = [d for d in docs if d["kind"] == "Job"]
        return j["metadata"]["name"], j["spec"]["template"]

    sha = "0123456789abcdef0123456789abcdef01234567"
    variants = {
        "as installed": {},
        # server changes that leave the Job's pod alone
        "server": {"server": {"maxRunningRequests": 32, "replicas": 3}},
        "router": {"router": {"replicas": 1}},
        # changes of the Job's pod itself
        "new revision": {"models": {"target": {"revision": sha}}},
        "new image tag": {"image": {"tag": "0.1.1"}},
        "download image": {"models": {"download": {"image": {"repository": "hf", "tag": "1"}}}},
        "download resources": {"models": {"download": {"resources": {"requests": {"cpu": "2"}}}}},
        "token secret": {"models": {"download": {"hfTokenSecret": {"name": "hf"}}}},
        "pull secrets": {"imagePullSecrets": [{"name": "registry"}]},
        "node selector": {"models": {"prefetch": {"nodeSelector": {"pool": "cpu"}}}},
    }
    rendered = {label: job(values) for label, values in variants.items()}
    by_name: dict[str, list[str]] = {}
    for label, (name, _) in rendered.items():
        by_name.setdefault(name, []).append(label)
    for labels in by_name.values():
        templates = [rendered[label][1] for label in labels]
        assert all(t == templates[0] for t in templates), labels  # one name, one template
    first = rendered["as installed"][0]
    # a server or router change keeps the same Job (nothing to re-run, nothing to patch)
    assert rendered["server"][0] == rendered["router"][0] == first
    # every change of the pod template is a new Job
    changed = [label for label in variants if label not in ("as installed", "server", "router")]
    assert len({rendered[label][0] for label in changed} | {first}) == len(changed) + 1


@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_server_never_writes_its_models(profile):
    for files in ((PROFILES[profile],), (PROFILES[profile], FULL)):
        docs = render(*files)
        for doc, _, c in all_containers(docs):
            if c["name"] == "sglang":
                (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
                assert mount["readOnly"] is True, doc["metadata"]["name"]


def test_pinned_revisions_can_be_required(tmp_path):
    base = PROFILES["qwen3-8b-dspark"]
    err = fails(tmp_path, {"models": {"requirePinnedRevision": True}}, base)
    assert re.search(
        r"models\.(target|draft)\.revision for \S+ must be a commit \(40 hex digits\)", err
    ), err
    sha = "0123456789abcdef0123456789abcdef01234567"
    pinned = {
        "models": {
            "requirePinnedRevision": True,
            "target": {"revision": sha},
            "draft": {"revision": sha.replace("0", "f")},
        }
    }
    docs = render_overlay(tmp_path, pinned, base)
    models = json.loads(
        env_of(container(server_pod(docs), "wait-for-models"))["DSPARK_MODELS"]["value"]
    )
    assert {m["revision"] for m in models} == {sha, sha.replace("0", "f")}


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def _bytes(q) -> int:
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m, q
    return int(m.group(1)) * _QUANTITY.get(m.group(2), 1)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_emptydir_is_bounded_and_requested_as_ephemeral_storage(profile):
    renders = [render(PROFILES[profile]), render(PROFILES[profile], FULL)]
    for docs in renders:
        for doc in docs:
            for tmpl in pod_templates(doc):
                spec = tmpl["spec"]
                disk = [
                    v["emptyDir"]
                    for v in spec.get("volumes", [])
                    if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
                ]
                if not disk:
                    continue
                for e in disk:
                    assert "sizeLimit" in e, doc["metadata"]["name"]
                need = sum(_bytes(e["sizeLimit"]) for e in disk)
                containers = spec["containers"]
                asked = sum(
                    _bytes(c.get("resources", {}).get("requests", {}).get("ephemeral-storage", 0))
                    for c in containers
                )
                asked = max(
                    [asked]
                    + [
                        _bytes(
                            c.get("resources", {}).get("requests", {}).get("ephemeral-storage", 0)
                        )
                        for c in spec.get("initContainers", [])
                    ]
                )
                assert asked >= need, (profile, doc["kind"], doc["metadata"]["name"], need, asked)


def _fake_hub(tmp_path: Path, models: list[dict], **extra: str) -> dict[str, str]:
    """Environment for download_models.py with a fake huggingface_hub on PYTHONPATH (no
    network): model_info resolves any revision to one commit; snapshot_download writes a file
    and logs the repo (sleeping FAKE_HUB_SLEEP seconds first)."""
    hub = tmp_path / "fakehub" / "huggingface_hub"
    hub.mkdir(parents=True, exist_ok=True)
    (hub / "__init__.py").write_text(
        textwrap.dedent(
            """
        import os, pathlib, time
        COMMIT = "c0ffee" * 6 + "c0ff"
        class _Info:
            sha = COMMIT
        class HfApi:
            def model_info(self, repo, revision=None):
                return _Info()
        def snapshot_download(repo_id, revision, local_dir):
            assert revision == COMMIT, revision
            time.sleep(float(os.environ.get("FAKE_HUB_SLEEP", "0")))
            with open(os.environ["FAKE_HUB_LOG"], "a") as log:
                log.write(repo_id + "\\n")
            pathlib.Path(local_dir, "config.json").write_text("{}")
        """
        )
    )
    return (
        os.environ
        | {
            "DSPARK_MODELS": json.dumps(models),
            "FAKE_HUB_LOG": str(tmp_path / "downloads.log"),
            "PYTHONPATH": str(tmp_path / "fakehub"),
        }
        | extra
    )


def _download(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(FILES / "download_models.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_download_resolves_the_commit_locks_and_skips_what_is_complete(tmp_path):
    models = [
        {
            "role": "target",
            "repo": "org/m",
            "revision": "",
            "dir": str(tmp_path / "v" / "org" / "m"),
        }
    ]
    env = _fake_hub(tmp_path, models, FAKE_HUB_SLEEP="1")
    # two replicas sharing a volume start together: one downloads, the other waits on the lock
    procs = [
        subprocess.Popen(
            [sys.executable, str(FILES / "download_models.py")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert (tmp_path / "downloads.log").read_text().splitlines() == ["org/m"]
    marker = json.loads((Path(models[0]["dir"]) / ".dspark-download-complete").read_text())
    assert marker == {"repo": "org/m", "revision": "main", "commit": "c0ffee" * 6 + "c0ff"}
    assert any("pin it with models.target.revision=" + marker["commit"] in o for o in outs)
    assert any("already complete" in o for o in outs)
    # the servers' init container: complete, so --wait returns at once
    waited = _download(env | {"DSPARK_WAIT_TIMEOUT_SECONDS": "1"}, "--wait")
    assert waited.returncode == 0 and marker["commit"] in waited.stdout
    # a different requested revision is not the same download: wait until the deadline
    other = json.dumps([dict(models[0], revision="v2")])
    late = _download(env | {"DSPARK_MODELS": other, "DSPARK_WAIT_TIMEOUT_SECONDS": "0"}, "--wait")
    assert late.returncode == 1 and "org/m@v2" in late.stdout


@pytest.mark.parametrize(
    "profile, storage",
    [
        ("qwen3-8b-dspark", "volumeClaimTemplate"),
        ("deepseek-v4-flash-dspark", "volumeClaimTemplate"),
        ("cpu-smollm2", "emptyDir"),
    ],
)
def test_sps_table_and_jit_caches_live_on_the_cache_volume(profile, storage):
    docs = render(PROFILES[profile])
    sts = find(docs, "StatefulSet")
    pod = sts["spec"]["template"]
    sglang = container(pod, "sglang")
    mounts = {m["name"]: m["mountPath"] for m in sglang["volumeMounts"]}
    env = {k: v["value"] for k, v in env_of(sglang).items() if "value" in v}
    cache = mounts["cache"]
    for var in (
        "DSPARK_CACHE_DIR",
        "SGLANG_CACHE_DIR",
        "XDG_CACHE_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "CUDA_CACHE_PATH",
        "TILELANG_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
        "SGLANG_JIT_CACHE_DIR",
        "HF_HOME",
    ):
        assert env[var].startswith(cache + "/"), var
    if storage == "volumeClaimTemplate":
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "cache"
        assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
            "whenDeleted": "Retain",
            "whenScaled": "Retain",
        }
        assert "cache" not in {v["name"] for v in pod["spec"]["volumes"]}
    else:
        assert {v["name"]: v for v in pod["spec"]["volumes"]}["cache"]["emptyDir"]["sizeLimit"]


def test_cache_env_matches_what_sglang_and_the_plugin_read(tmp_path, monkeypatch):
    sglang = container(server_pod(render(PROFILES["qwen3-8b-dspark"])), "sglang")
    env = {k: v["value"] for k, v in env_of(sglang).items() if "value" in v}
    # SGLang's own derivation of the third-party JIT caches from SGLANG_CACHE_DIR
    code = (
        "import json; from sglang.srt.environ import third_party_cache_defaults; "
        "print(json.dumps(third_party_cache_defaults()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | {"SGLANG_CACHE_DIR": env["SGLANG_CACHE_DIR"]},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for var, path in json.loads(out.stdout.strip().splitlines()[-1]).items():
        assert env[var] == path, var
    # the plugin's SPS cache: <DSPARK_CACHE_DIR>/sps
    from sglang_dspark.serving import cache

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"


def _notes(*files: Path, release: str = RELEASE) -> str:
    from test_helm import helm_path

    cmd = [helm_path(), "install", release, str(CHART), "-n", NS, "--dry-run=client"]
    for f in files:
        cmd += ["-f", str(f)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def _readme_section(heading: str) -> str:
    """The chart README from `heading` to the next second-level heading."""
    readme = (CHART / "README.md").read_text()
    return readme.split(heading, 1)[1].split("\n## ", 1)[0]


def test_readme_and_notes_say_the_same_about_a_missing_sps_table():
    gpu = _notes(PROFILES["qwen3-8b-dspark"])
    cpu = _notes(PROFILES["cpu-smollm2"])
    for notes in (gpu, cpu):
        assert "profiles SPS(B) at start-up" in notes
        assert "DSPARK_CACHE_DIR=/var/cache/dspark/dspark" in notes
    assert "survives restarts: the next start reads it" in gpu
    assert "every new pod profiles again" in cpu
    readme = (CHART / "README.md").read_text()
    section = _readme_section("### Without an SPS table")
    for claim in (
        "profiles SPS(B) at start-up",
        "DSPARK_CACHE_DIR",
        "server.cache",
        "eager warm-up forwards",
        "calibration.sps",
    ):
        assert claim in section, claim
    assert "on the pod's disk" not in readme


# --------------------------------------------------------------------------------------------
# 3. autoscaling: HPA with the adapter rules it needs, or KEDA


def test_hpa_metrics_are_served_by_the_rendered_adapter_rules():
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    hpa = find(docs, "HorizontalPodAutoscaler")
    rules = yaml.safe_load(
        find(docs, "ConfigMap", "dspark-prometheus-adapter-rules")["data"]["rules.yaml"]
    )["rules"]
    served = set()
    for rule in rules:
        series = re.match(r"'?([a-z_:]+)\{", rule["seriesQuery"]).group(1)
        served.add(
            re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        )
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    for metric in hpa["spec"]["metrics"]:
        assert metric["pods"]["metric"]["name"] in served
    collector = (
        _package_dir("sglang") / "srt" / "observability" / "metrics_collector.py"
    ).read_text()
    for rule in rules:
        assert f'name="{rule["seriesQuery"].split("{")[0].strip(chr(39))}"' in collector


@pytest.mark.parametrize(
    "profile, period", [("qwen3-8b-dspark", 600), ("deepseek-v4-flash-dspark", 1800)]
)
def test_scale_up_is_paced_by_model_load_time(profile, period):
    docs = render(PROFILES[profile], FULL)
    behavior = find(docs, "HorizontalPodAutoscaler")["spec"]["behavior"]
    (up,) = behavior["scaleUp"]["policies"]
    assert (up["type"], up["value"], up["periodSeconds"]) == ("Pods", 1, period)
    startup = container(server_pod(docs), "sglang")["startupProbe"]
    # a replica gets its whole load (the startup probe's budget) before the next is added,
    # capped at 30 minutes for the 60-minute V4 budget
    assert (
        up["periodSeconds"] >= min(startup["periodSeconds"] * startup["failureThreshold"], 1800) / 3
    )
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 1800


@pytest.mark.parametrize("files", [("qwen3-8b-dspark",), ("deepseek-v4-flash-dspark", "2x8")])
def test_keda_scaledobject_scales_on_sglang_queue_and_running_requests(tmp_path, files):
    base = [PROFILES[files[0]]] + ([MULTINODE] if "2x8" in files else [])
    docs = render_overlay(
        tmp_path,
        {
            "autoscaling": {"enabled": True, "engine": "keda"},
            "monitoring": {"serviceMonitor": {"enabled": True}},
        },
        *base,
    )
    so = find(docs, "ScaledObject")
    validate_crd(so)
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]  # KEDA makes its own
    (workload,) = [d for d in docs if d["kind"] in ("StatefulSet", "LeaderWorkerSet")]
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": workload["apiVersion"],
        "kind": workload["kind"],
        "name": workload["metadata"]["name"],
    }
    assert "replicas" not in workload["spec"]
    queries = {t["name"]: t["metadata"]["query"] for t in so["spec"]["triggers"]}
    assert queries == {
        "queued-requests": f'sum(sglang:num_queue_reqs{{namespace="{NS}", job="{RELEASE}"}})',
        "running-requests": f'sum(sglang:num_running_reqs{{namespace="{NS}", job="{RELEASE}"}})',
    }
    assert {t["metricType"] for t in so["spec"]["triggers"]} == {"AverageValue"}
    # job = the release: what the chart's ServiceMonitor labels the series with
    assert (
        find(docs, "ServiceMonitor", "dspark-server")["spec"]["jobLabel"]
        == "app.kubernetes.io/instance"
    )
    up = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]["policies"]
    assert up[0]["value"] == 1


def test_keda_with_every_option_matches_its_crd():
    from test_helm import KEDA

    so = find(render(PROFILES["qwen3-8b-dspark"], FULL, KEDA), "ScaledObject")
    validate_crd(so)
    assert {t["authenticationRef"]["name"] for t in so["spec"]["triggers"]} == {"prometheus-auth"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)


def test_keda_needs_metrics_and_service_discovery(tmp_path):
    assert "needs monitoring.enableMetrics=true" in fails(
        tmp_path,
        {
            "autoscaling": {"enabled": True, "engine": "keda"},
            "monitoring": {"enableMetrics": False},
        },
    )
    assert "needs router.discovery=kubernetes" in fails(
        tmp_path,
        {"autoscaling": {"enabled": True, "engine": "keda"}, "router": {"discovery": "static"}},
    )


def test_keda_selects_series_the_chart_knows_are_labelled_so(tmp_path):
    keda = {"autoscaling": {"enabled": True, "engine": "keda"}}
    # job=<release> exists only on series scraped by the chart's ServiceMonitor: without it
    # the triggers would read nothing and never scale
    err = fails(tmp_path, keda)
    assert "set monitoring.serviceMonitor.enabled=true" in err, err
    assert "autoscaling.keda.seriesSelector" in err, err
    selector = 'namespace="llm", app_kubernetes_io_instance="dspark"'
    docs = render_overlay(
        tmp_path, {"autoscaling": {**keda["autoscaling"], "keda": {"seriesSelector": selector}}}
    )
    so = find(docs, "ScaledObject")
    validate_crd(so)
    assert {t["metadata"]["query"] for t in so["spec"]["triggers"]} == {
        f"sum(sglang:num_queue_reqs{{{selector}}})",
        f"sum(sglang:num_running_reqs{{{selector}}})",
    }
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]


def test_hpa_scales_on_both_targets_unless_given_its_own_metrics(tmp_path):
    def hpa_metrics(values):
        docs = render_overlay(tmp_path, {"autoscaling": {"enabled": True, **values}})
        return {
            m["pods"]["metric"]["name"]: m["pods"]["target"]
            for m in find(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
        }

    # the same two targets KEDA uses, per replica
    assert hpa_metrics({"targetQueueLength": 3, "targetRunningRequests": 20}) == {
        "sglang_num_queue_reqs": {"type": "AverageValue", "averageValue": "3"},
        "sglang_num_running_reqs": {"type": "AverageValue", "averageValue": "20"},
    }
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["autoscaling"]
    assert hpa_metrics({}) == {
        "sglang_num_queue_reqs": {
            "type": "AverageValue",
            "averageValue": str(defaults["targetQueueLength"]),
        },
        "sglang_num_running_reqs": {
            "type": "AverageValue",
            "averageValue": str(defaults["targetRunningRequests"]),
        },
    }
    own = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "sglang_num_running_reqs"},
                "target": {"type": "AverageValue", "averageValue": "32"},
            },
        }
    ]
    assert hpa_metrics({"metrics": own}) == {
        "sglang_num_running_reqs": {"type": "AverageValue", "averageValue": "32"}
    }


# --------------------------------------------------------------------------------------------
# 4. A/B in the cluster: dashboard per release, comparison Job, report


def _dashboard(docs: list[dict]) -> dict:
    cm = find(
        docs,
        "ConfigMap",
        next(d["metadata"]["name"] for d in docs if d["metadata"]["name"].endswith("-dashboard")),
    )
    (text,) = cm["data"].values()
    return json.loads(text)


def test_each_release_gets_its_own_dashboard_split_by_release():
    a = _dashboard(render(PROFILES["qwen3-8b-dspark"], release="dspark"))
    b = _dashboard(render(PROFILES["qwen3-8b-mtp1-baseline"], release="mtp1"))
    c = _dashboard(render(PROFILES["qwen3-8b-dspark"], release="dspark", namespace="other"))
    assert len({a["uid"], b["uid"], c["uid"]}) == 3
    assert all(len(d["uid"]) <= 40 for d in (a, b, c))
    assert a["title"] != b["title"]
    job = {v["name"]: v for v in b["templating"]["list"]}["job"]
    assert job["current"]["value"] == ["mtp1"] and job["multi"] is True  # add dspark for the A/B
    for panel in a["panels"]:
        for t in panel["targets"]:
            expr = t["expr"]
            # no aggregation that folds the releases together
            for agg in re.findall(r"\b(?:sum|avg|max|min)\s*(?:by\s*\(([^)]*)\))?\s*\(", expr):
                assert "job" in agg, (panel["title"], expr)
            assert "{{job}}" in t["legendFormat"], panel["title"]


def test_dashboard_has_router_and_end_to_end_panels_on_metrics_that_exist():
    d = _dashboard(render())
    exprs = " ".join(t["expr"] for p in d["panels"] for t in p["targets"])
    assert "sglang:e2e_request_latency_seconds_bucket" in exprs
    assert "smg_http_request_duration_seconds_bucket" in exprs
    # SMG registers its metrics in its Rust extension (model_gateway/src/observability/metrics.rs)
    (binary,) = _package_dir("smg").glob("smg_rs*.so")
    data = binary.read_bytes()
    metrics = set(re.findall(r"smg_[a-z_]+", exprs))
    assert len(metrics) >= 5, metrics
    for metric in metrics:
        base = re.sub(r"_(bucket|sum|count)$", "", metric)
        assert base.encode() in data, metric  # the smg the router image pins exports it


def _wait_ready_module():
    """files/wait_ready.py as a module, without leaving bytecode in the chart."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wait_ready", FILES / "wait_ready.py")
    module = importlib.util.module_from_spec(spec)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = saved
    return module


def test_loadtest_capacity_is_the_fleet_a_run_starts_on(tmp_path):
    def run(values):
        base = {"loadtest": {"enabled": True}, "server": {"maxRunningRequests": 16}}
        docs = render_overlay(tmp_path, {**base, **values})
        pod = loadtest_pod(docs)["spec"]
        users = env_of(pod["initContainers"][1])["SLA_USERS"]["value"]
        replicas = env_of(pod["containers"][0])["REPLICAS"]["value"]
        return users, replicas

    assert run({"server": {"maxRunningRequests": 16, "replicas": 2}}) == ("1,2,4,8,16,32", "2")
    # with an autoscaler server.replicas is not the fleet: a run starts on its minimum
    autoscaled = {
        "server": {"maxRunningRequests": 16, "replicas": 1},
        "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 6},
    }
    assert run(autoscaled) == ("1,2,4,8,16,32,48", "3")
    notes = _notes(values_file(tmp_path, {**autoscaled, "loadtest": {"enabled": True}}))
    assert "autoscaling is on, so the fleet can grow during a run" in notes
    assert "fleet can grow" not in _notes(values_file(tmp_path, {"loadtest": {"enabled": True}}))


def test_wait_ready_waits_for_every_replica_of_every_arm():
    wait_ready = _wait_ready_module()

    def listing(ready, want=2, generation=(3, 3), updated=None):
        return {
            "items": [
                {
                    "metadata": {"name": "x-server", "generation": generation[1]},
                    "spec": {"replicas": want},
                    "status": {
                        "readyReplicas": ready,
                        "observedGeneration": generation[0],
                        "updatedReplicas": want if updated is None else updated,
                    },
                }
            ]
        }

    def getter(sts=None, lws_=None):
        def get(path, query):
            assert query == {
                "labelSelector": "app.kubernetes.io/instance=mtp1,app.kubernetes.io/component=server"
            }
            return sts if "statefulsets" in path else lws_

        return get

    assert wait_ready.workload_problems("mtp1", NS, getter(listing(2))) == []
    assert wait_ready.workload_problems("mtp1", NS, getter(listing(1)))  # one still loading
    assert wait_ready.workload_problems("mtp1", NS, getter(listing(2, updated=1)))  # rolling
    assert wait_ready.workload_problems("mtp1", NS, getter(listing(2, generation=(2, 3))))
    assert wait_ready.workload_problems("mtp1", NS, getter(None, None))  # nothing installed
    assert wait_ready.workload_problems("mtp1", NS, getter({"items": []}, listing(2))) == []  # LWS


def test_wait_ready_checks_the_arm_url_with_the_key(fake_server):  # noqa: F811
    handler, url = fake_server
    wait_ready = _wait_ready_module()
    assert wait_ready.url_problem(url, "k") is None and handler.auth[-1] == "Bearer k"
    assert wait_ready.url_problem("http://127.0.0.1:9", "") is not None


def test_ab_run_two_arms_then_the_pareto_report(fake_server, tmp_path):  # noqa: F811
    handler, url = fake_server
    handler.answer = "one two three four five six seven eight"
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    pod = loadtest_pod(docs)["spec"]
    data = find(docs, "ConfigMap", "dspark-loadtest")["data"]
    run = "dspark-ab-1"
    for sweep in pod["initContainers"][1:]:
        _run_sweep(sweep, data, url, tmp_path, run)
    (report,) = pod["containers"]
    results = tmp_path / "results"
    script = report["command"][-1].replace("/results", str(results))
    bindir = Path(sys.executable).parent
    env = {e["name"]: e["value"] for e in report["env"] if "value" in e}
    env |= {
        "RUN_NAME": run,
        "HOLD_SECONDS": "0",
        "REPLICAS": "1",
        "MPLCONFIGDIR": str(tmp_path / "mpl"),
        "HOME": str(tmp_path),
        "PATH": f"{bindir}:{os.environ['PATH']}",
    }
    result = subprocess.run(
        ["/bin/sh", "-c", script],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = results / run / "report"
    for name in ("pareto.png", "pareto.csv", "pareto.json", "report.txt"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "pareto.json").read_text())
    assert {a["label"] for a in summary["arms"]} == {"dspark", "mtp1"}
    assert summary["comparison"]["arm"] == "dspark" and summary["comparison"]["baseline"] == "mtp1"
    assert "arm dspark: locust exit 0" in result.stdout and "dspark vs mtp1" in result.stdout


# --------------------------------------------------------------------------------------------
# 5. router: light pinned gateway image, API key, Ingress/TLS, coherent cache-aware routing


def test_router_runs_the_pinned_gateway_image_everywhere():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    pin = re.search(r"^ARG SMG_VERSION=(\S+)$", dockerfile, re.MULTILINE).group(1)
    assert re.fullmatch(r"\d+\.\d+\.\d+", pin), pin
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"smg=={pin}"' in pyproject  # the tests parse the router's arguments with it
    assert "sglang-router" not in pyproject and "sglang-router" not in dockerfile
    from importlib.metadata import version

    assert version("smg") == pin
    for profile in PROFILES:
        router = container(
            find(render(PROFILES[profile]), "Deployment")["spec"]["template"], "router"
        )
        # SMG's image, tagged with the wheel's version (no "v"); no CUDA server image
        assert router["image"] == f"lightseekorg/smg:{pin}"
        assert router["command"] == ["python3", "-m", "smg.launch_router"]  # its ENTRYPOINT
        assert "nvidia.com/gpu" not in json.dumps(router["resources"])


def test_router_api_key_comes_from_a_secret_and_every_client_sends_it():
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    assert not [d for d in docs if d["kind"] == "Secret"]
    ref = {"secretKeyRef": {"name": "dspark-api-key", "key": "api-key"}}
    router = container(find(docs, "Deployment")["spec"]["template"], "router")
    assert parse_args(router["args"])["--api-key"] == ["$(ROUTER_API_KEY)"]
    assert env_of(router)["ROUTER_API_KEY"] == {"name": "ROUTER_API_KEY", "valueFrom": ref}
    assert "dspark-api-key" not in json.dumps(router["args"])
    chat = find(docs, "Pod", "dspark-test-chat")["spec"]["containers"][0]
    assert env_of(chat)["API_KEY"]["valueFrom"] == ref
    for c in loadtest_pod(docs)["spec"]["initContainers"]:
        assert env_of(c)["SLA_API_KEY"]["valueFrom"] == ref, c["name"]


def test_helm_test_chat_sends_the_api_key(fake_server):  # noqa: F811
    handler, url = fake_server
    pod = find(render(PROFILES["qwen3-8b-dspark"], FULL), "Pod", "dspark-test-chat")
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e} | {
        "API_URL": url,
        "TIMEOUT_SECONDS": "5",
        "API_KEY": "sekret",
    }
    result = subprocess.run(
        [sys.executable, "-B", str(FILES / "test_chat.py")],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(handler.auth) == {"Bearer sekret"}


def test_ingress_with_tls_fronts_the_router_api():
    docs = render(PROFILES["qwen3-8b-dspark"], FULL)
    ing = find(docs, "Ingress", "dspark-router")
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [
        {"secretName": "llm-example-com-tls", "hosts": ["llm.example.com"]}
    ]
    (rule,) = ing["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    backend = path["backend"]["service"]
    svc = find(docs, "Service", backend["name"])
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert "Ingress" not in {d["kind"] for d in render(PROFILES["qwen3-8b-dspark"])}


@pytest.mark.parametrize(
    "replicas, policy, affinity",
    [
        (2, "cache_aware", "ClientIP"),
        (1, "cache_aware", "None"),
        (2, "round_robin", "None"),
    ],
)
def test_cache_aware_router_replicas_keep_a_client_on_one_radix_tree(
    tmp_path, replicas, policy, affinity
):
    docs = render_overlay(tmp_path, {"router": {"replicas": replicas, "policy": policy}})
    svc = find(docs, "Service", "dspark-router")["spec"]
    assert svc["sessionAffinity"] == affinity
    if affinity == "ClientIP":
        assert svc["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] == 10800


# --------------------------------------------------------------------------------------------
# 6. hardening: read-only root filesystem with writable caches, PDBs right for one replica


@pytest.mark.parametrize("profile", list(PROFILES))
def test_server_root_filesystem_is_read_only_and_its_writable_paths_are_volumes(profile):
    docs = render(PROFILES[profile])
    if profile in V4_PROFILES:
        docs += multinode(profile)
    for doc, pod, c in all_containers(docs):
        if c["name"] != "sglang":
            continue
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        writable = [p for p, m in mounts.items() if not m.get("readOnly")]
        env = {k: v["value"] for k, v in env_of(c).items() if "value" in v}
        for var in ("HOME", "DSPARK_CACHE_DIR", "SGLANG_CACHE_DIR", "TRITON_CACHE_DIR"):
            assert any(
                env[var] == p or env[var].startswith(p.rstrip("/") + "/") for p in writable
            ), var
        assert "/tmp" in writable and "/dev/shm" in writable


@pytest.mark.parametrize(
    "values, spec",
    [
        ({"server": {"replicas": 1}}, {"minAvailable": 1}),  # a drain waits for an operator
        ({"server": {"replicas": 3}}, {"maxUnavailable": 1}),
        (
            {"server": {"replicas": 1}, "autoscaling": {"enabled": True, "minReplicas": 1}},
            {"minAvailable": 1},
        ),
        (
            {"server": {"replicas": 1}, "autoscaling": {"enabled": True, "minReplicas": 2}},
            {"maxUnavailable": 1},
        ),
        (
            {"server": {"replicas": 1, "pdb": {"maxUnavailable": 1}}},
            {"maxUnavailable": 1},
        ),  # explicit
    ],
)
def test_server_pdb_never_lets_a_drain_evict_the_only_replica(tmp_path, values, spec):
    pdb = find(render_overlay(tmp_path, values), "PodDisruptionBudget", "dspark-server")["spec"]
    assert {k: v for k, v in pdb.items() if k != "selector"} == spec


def test_multinode_pdb_counts_pods_of_the_only_group(tmp_path):
    docs = multinode("deepseek-v4-flash-dspark")
    pdb = find(docs, "PodDisruptionBudget", "dspark-server")["spec"]
    assert pdb["minAvailable"] == 2  # both pods of the one group
    docs = render_overlay(
        tmp_path, {"server": {"replicas": 2}}, PROFILES["deepseek-v4-flash-dspark"], MULTINODE
    )
    assert find(docs, "PodDisruptionBudget", "dspark-server")["spec"]["maxUnavailable"] == 1
    assert not [
        d
        for d in render_overlay(tmp_path, {"server": {"replicas": 0}})
        if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "dspark-server"
    ]


def test_multinode_notes_wait_for_the_group_to_be_available():
    notes = _notes(PROFILES["deepseek-v4-flash-dspark"], MULTINODE)
    # kubectl rollout status knows no LeaderWorkerSet; its Available condition says it
    assert (
        f"kubectl -n {NS} wait --for=condition=Available leaderworkerset/dspark-server-lws" in notes
    )
    assert "logs -f dspark-server-lws-0 -c sglang" in notes  # the leader (node rank 0)
    single = _notes(PROFILES["deepseek-v4-flash-dspark"])
    assert f"kubectl -n {NS} rollout status statefulset/dspark-server --timeout=60m" in single


def test_single_replica_notes_warn_about_drains():
    assert "its PodDisruptionBudget (minAvailable) makes node drains wait" in _notes(
        PROFILES["cpu-smollm2"]
    )
    assert "makes node drains wait" not in _notes(PROFILES["qwen3-8b-dspark"])


# --------------------------------------------------------------------------------------------
# 7. prefill/decode disaggregation (off by default; rendered and validated, never run here)


def pd(profile: str = "qwen3-8b-dspark", *more) -> list[dict]:
    return render(PROFILES[profile], FULL, PD, *more)


def sglang_container(tmpl: dict) -> dict:
    return container(tmpl, "sglang")


def test_pd_is_off_by_default_and_leaves_the_single_server_alone():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["server"]["disaggregation"]["enabled"] is False
    for profile in PROFILES:
        docs = render(PROFILES[profile], FULL)
        assert [d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet"] == [
            "dspark-server"
        ]
        text = json.dumps(docs)
        assert "disaggregation" not in text and "dspark.io/pd-role" not in text
        assert "IPC_LOCK" not in text and "sglang.ai/bootstrap-port" not in text


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_pd_renders_a_prefill_and_a_decode_statefulset(profile):
    docs = pd(profile)
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert set(sets) == {"dspark-prefill", "dspark-decode"}  # instead of dspark-server
    assert sets["dspark-prefill"]["spec"]["replicas"] == 2  # pd.yaml
    assert sets["dspark-decode"]["spec"]["replicas"] == 3
    roles = pd_role_templates(docs)
    assert set(roles) == {"prefill", "decode"}
    for role, name in (("prefill", "dspark-prefill"), ("decode", "dspark-decode")):
        sts = sets[name]
        labels = roles[role]["metadata"]["labels"]
        assert labels["dspark.io/pd-role"] == role
        # each StatefulSet owns its role's pods only
        selector = sts["spec"]["selector"]["matchLabels"]
        other = roles["decode" if role == "prefill" else "prefill"]["metadata"]["labels"]
        assert selector.items() <= labels.items() and not selector.items() <= other.items()
        assert sts["spec"]["serviceName"] == "dspark-server-headless"
    prefill, decode = (sglang_container(roles[r]) for r in ("prefill", "decode"))
    pa, da = parse_args(prefill["args"]), parse_args(decode["args"])
    assert pa["--disaggregation-mode"] == ["prefill"] and da["--disaggregation-mode"] == ["decode"]
    for args in (pa, da):
        assert args["--disaggregation-transfer-backend"] == ["mooncake"]
        assert args["--disaggregation-ib-device"] == ["mlx5_0,mlx5_1"]
    # the bootstrap server runs on the prefill servers only, on a named port
    assert pa["--disaggregation-bootstrap-port"] == ["8998"]
    assert "--disaggregation-bootstrap-port" not in da
    ports = {p["name"]: p["containerPort"] for p in prefill["ports"]}
    assert ports["bootstrap"] == 8998 and ports["http"] != 8998
    assert "bootstrap" not in {p["name"] for p in decode["ports"]}
    # per-role extra args come last, on their role only
    assert prefill["args"][-2:] == ["--chunked-prefill-size", "8192"]
    assert decode["args"][-2:] == ["--disaggregation-decode-polling-interval", "2"]
    assert (
        "--chunked-prefill-size" not in da and "--disaggregation-decode-polling-interval" not in pa
    )
    # apart from the PD flags both roles run the same server: model, parallelism, speculation
    pd_flags = {"--disaggregation-mode", "--disaggregation-bootstrap-port"}
    common = {k: v for k, v in pa.items() if k not in pd_flags and k != "--chunked-prefill-size"}
    assert common == {
        k: v
        for k, v in da.items()
        if k not in pd_flags and k != "--disaggregation-decode-polling-interval"
    }
    assert env_of(prefill) == env_of(decode)
    # the single server's GPUs; RDMA: the device (requests = limits) and IPC_LOCK, on the
    # server containers only
    single = container(server_pod(render(PROFILES[profile])), "sglang")["resources"]["limits"]
    for c in (prefill, decode):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == single["nvidia.com/gpu"]
        assert c["resources"]["requests"]["rdma/ib"] == c["resources"]["limits"]["rdma/ib"] == 1
        caps = c["securityContext"]["capabilities"]
        assert caps == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["privileged"] is False
    for doc, _, c in all_containers(docs):
        if c not in (prefill, decode):
            assert "add" not in c.get("securityContext", {}).get("capabilities", {}), c["name"]
            assert "rdma/ib" not in json.dumps(c.get("resources", {})), c["name"]


def test_pd_roles_take_their_own_resources_and_rdma_device(tmp_path):
    mine = {"requests": {"cpu": "16", "memory": "96Gi", "ephemeral-storage": "16Gi"}}
    docs = render_overlay(
        tmp_path,
        {
            "server": {
                "disaggregation": {
                    "prefill": {"resources": mine},
                    "rdma": {"resourceName": "rdma/hca_shared_devices_a", "count": 2},
                }
            }
        },
        PROFILES["qwen3-8b-dspark"],
        FULL,
        PD,
    )
    roles = pd_role_templates(docs)
    prefill, decode = (sglang_container(roles[r])["resources"] for r in ("prefill", "decode"))
    assert prefill["requests"] == {
        **mine["requests"],
        "nvidia.com/gpu": 1,
        "rdma/hca_shared_devices_a": 2,
    }
    assert prefill["limits"] == {"nvidia.com/gpu": 1, "rdma/hca_shared_devices_a": 2}
    server = container(server_pod(render(PROFILES["qwen3-8b-dspark"])), "sglang")["resources"]
    assert decode["requests"] == {**server["requests"], "rdma/hca_shared_devices_a": 2}
    # no RDMA device plugin: no extended resource (IPC_LOCK stays)
    docs = render_overlay(
        tmp_path,
        {"server": {"disaggregation": {"rdma": {"resourceName": ""}}}},
        PROFILES["qwen3-8b-dspark"],
        FULL,
        PD,
    )
    for tmpl in pd_role_templates(docs).values():
        c = sglang_container(tmpl)
        assert c["resources"] == server
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_pd_services_budgets_and_network_policy_cover_both_roles():
    docs = pd()
    roles = pd_role_templates(docs)
    labels = {role: t["metadata"]["labels"] for role, t in roles.items()}

    def selects(selector, role):
        return selector.items() <= labels[role].items()

    # every pod under the headless Service (stable names, metrics) and the server Service
    for name in ("dspark-server-headless", "dspark-server"):
        selector = find(docs, "Service", name)["spec"]["selector"]
        assert selects(selector, "prefill") and selects(selector, "decode"), name
    monitor = find(docs, "ServiceMonitor", "dspark-server")["spec"]["selector"]["matchLabels"]
    assert (
        monitor.items()
        <= find(docs, "Service", "dspark-server-headless")["metadata"]["labels"].items()
    )
    # one budget per role (2 and 3 replicas: one pod of each may go)
    budgets = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"dspark-prefill", "dspark-decode", "dspark-router"}
    for role in ("prefill", "decode"):
        spec = budgets[f"dspark-{role}"]
        assert spec["maxUnavailable"] == 1
        assert (
            spec["selector"]["matchLabels"]
            == find(docs, "StatefulSet", f"dspark-{role}")["spec"]["selector"]["matchLabels"]
        )
    # the router reaches both roles' API; the roles reach each other on every port (the
    # prefill's bootstrap port, Mooncake / NIXL transfer ports)
    policy = find(docs, "NetworkPolicy", "dspark-server")["spec"]
    assert selects(policy["podSelector"]["matchLabels"], "prefill")
    assert selects(policy["podSelector"]["matchLabels"], "decode")
    (api,) = [
        r for r in policy["ingress"] if r.get("ports") == [{"port": "http", "protocol": "TCP"}]
    ]
    expr = {e["key"]: e["values"] for e in api["from"][0]["podSelector"]["matchExpressions"]}
    assert "router" in expr["app.kubernetes.io/component"]
    (peers,) = [r for r in policy["ingress"] if "ports" not in r]
    (peer,) = peers["from"]
    assert selects(peer["podSelector"]["matchLabels"], "decode")
    assert selects(peer["podSelector"]["matchLabels"], "prefill")


def test_pd_budgets_keep_each_roles_last_pod(tmp_path):
    docs = render_overlay(
        tmp_path,
        {"server": {"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}},
        PROFILES["qwen3-8b-dspark"],
        FULL,
        PD,
    )
    for role in ("prefill", "decode"):
        spec = find(docs, "PodDisruptionBudget", f"dspark-{role}")["spec"]
        assert {k: v for k, v in spec.items() if k != "selector"} == {"minAvailable": 1}
    notes = _notes(
        PROFILES["qwen3-8b-dspark"],
        FULL,
        PD,
        values_file(
            tmp_path,
            {"server": {"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}},
        ),
    )
    assert "one prefill replica: its PodDisruptionBudget" in notes
    assert "one decode replica: its PodDisruptionBudget" in notes


def test_pd_load_test_and_notes_follow_the_decode_replicas():
    docs = pd()  # 3 decode replicas, 64 running requests each (the profile)
    pod = loadtest_pod(docs)["spec"]
    assert env_of(pod["initContainers"][1])["SLA_USERS"]["value"] == "1,2,4,8,16,32,64,128,192"
    assert env_of(pod["containers"][0])["REPLICAS"]["value"] == "3"
    notes = _notes(PROFILES["qwen3-8b-dspark"], FULL, PD)
    assert f"kubectl -n {NS} rollout status statefulset/dspark-prefill --timeout=60m" in notes
    assert f"kubectl -n {NS} rollout status statefulset/dspark-decode --timeout=60m" in notes
    assert "have not been run under --disaggregation-mode" in notes


def _with_pd(values: dict) -> dict:
    out = copy.deepcopy(values)
    out.setdefault("server", {}).setdefault("disaggregation", {})["enabled"] = True
    return out


@pytest.mark.parametrize(
    "base, values, words",
    [
        (("deepseek-v4-flash-dspark", "2x8"), {}, "server.disaggregation with server.multiNode"),
        (("qwen3-8b-dspark",), {"autoscaling": {"enabled": True}}, "with autoscaling"),
        (("qwen3-8b-dspark",), {"router": {"enabled": False}}, "needs router.enabled=true"),
        (("cpu-smollm2",), {}, "server.disaggregation needs GPUs"),
        (
            ("qwen3-8b-dspark",),
            {"server": {"disaggregation": {"transferBackend": "fake"}}},
            'transferBackend="fake": the chart renders mooncake or nixl',
        ),
        (
            ("qwen3-8b-dspark",),
            {"server": {"disaggregation": {"transferBackend": "rdma"}}},
            'transferBackend="rdma": the chart renders mooncake or nixl',
        ),
        (
            ("qwen3-8b-dspark",),
            {"server": {"disaggregation": {"bootstrapPort": 30000}}},
            "bootstrapPort (30000) must differ from server.port",
        ),
        (
            ("qwen3-8b-dspark",),
            {"server": {"disaggregation": {"decode": {"policy": "power_of_two"}}}},
            "power_of_two for the decode role with server.disaggregation.decode.replicas=1",
        ),
        (
            # with discovery SMG's IGW mode may apply router.policy to both roles
            ("qwen3-8b-dspark",),
            {
                "router": {"policy": "power_of_two"},
                "server": {
                    "disaggregation": {
                        "prefill": {"policy": "round_robin"},
                        "decode": {"replicas": 2},
                    }
                },
            },
            "power_of_two for the prefill role with server.disaggregation.prefill.replicas=1",
        ),
        (
            ("deepseek-v4-flash-dspark",),
            {"server": {"disaggregation": {"targetModelType": "deepseek_v41"}}},
            (
                "DSpark PD on DeepSeek-V4.1 (server.disaggregation.targetModelType=deepseek_v41) "
                "needs static verify"
            ),
        ),
    ],
)
def test_chart_refuses_pd_that_cannot_work(tmp_path, base, values, words):
    files = [PROFILES[base[0]]] + ([MULTINODE] if "2x8" in base else [])
    err = fails(tmp_path, _with_pd(values), *files)
    assert words in err, err


@pytest.mark.parametrize(
    "values",
    [
        # power_of_two with two replicas of each role
        {
            "router": {"policy": "power_of_two"},
            "server": {"disaggregation": {"prefill": {"replicas": 2}, "decode": {"replicas": 2}}},
        },
        # with a static list the per-role policy is the prefill's own
        {
            "router": {"policy": "power_of_two", "discovery": "static"},
            "server": {
                "disaggregation": {"prefill": {"policy": "round_robin"}, "decode": {"replicas": 2}}
            },
        },
        # DeepSeek-V4.1 with static verify, as SGLang requires
        {
            "speculative": {"dspark": {"raggedVerifyMode": "static", "scheduler": "static"}},
            "server": {"disaggregation": {"targetModelType": "deepseek_v41"}},
        },
        {"server": {"disaggregation": {"transferBackend": "nixl"}}},
    ],
)
def test_pd_combinations_that_work_render(tmp_path, values):
    result = template(PROFILES["deepseek-v4-flash-dspark"], values_file(tmp_path, _with_pd(values)))
    assert result.returncode == 0, result.stderr


def test_pd_schema_refuses_a_role_without_replicas(tmp_path):
    result = template(
        values_file(tmp_path, _with_pd({"server": {"disaggregation": {"decode": {"replicas": 0}}}}))
    )
    assert result.returncode != 0
    assert "'/server/disaggregation/decode/replicas'" in result.stderr, result.stderr


def test_readme_says_how_to_turn_pd_on_and_that_it_never_ran():
    section = _readme_section("## Prefill/decode disaggregation")
    for claim in (
        "server.disaggregation.enabled",
        "--disaggregation-mode prefill",
        "IPC_LOCK",
        "rdma/ib",
        "Mooncake or NIXL",
        "sglang.ai/bootstrap-port",
        "--pd-disaggregation",
        # what the chart refuses
        "multiNode",
        "autoscaling",
        "router.enabled",
        "device=cpu",
        "power_of_two",
        "deepseek_v41",
        "static verify",
    ):
        assert claim in section, claim
    # the honest part: the plugin has never been run in PD mode (true while no file of the
    # package or its tests, the chart's own tests aside, mentions it; once one does, this
    # README sentence is stale)
    assert "have not been run under\n`--disaggregation-mode`" in section
    for root in (REPO / "sglang_dspark", REPO / "tests"):
        for path in root.rglob("*.py"):
            if path.name not in ("test_helm.py", "test_helm_fleet.py"):
                assert "disaggregation_mode" not in path.read_text(errors="ignore"), path


# --------------------------------------------------------------------------------------------
# the walk-through


def test_readme_walks_from_install_to_the_ab_report():
    readme = (CHART / "README.md").read_text()
    steps = [
        "helm install dspark ./helm/dspark -f helm/dspark/profiles/qwen3-8b-dspark.yaml",
        "helm install mtp1 ./helm/dspark -f helm/dspark/profiles/qwen3-8b-mtp1-baseline.yaml",
        "kubectl -n llm create job --from=cronjob/dspark-loadtest $RUN",
        "kubectl -n llm exec job/$RUN -c report -- tar czf - -C /results $RUN > $RUN.tgz",
    ]
    positions = [readme.find(s) for s in steps]
    assert all(p >= 0 for p in positions), [
        s for s, p in zip(steps, positions, strict=True) if p < 0
    ]
    assert positions == sorted(positions)
    # the README's commands are the NOTES' commands for the same release
    notes = _notes(PROFILES["qwen3-8b-dspark"], FULL)
    assert steps[2].replace("-n llm", f"-n {NS}") in notes and steps[3] in notes

"""deploy/k8s: every manifest passes the Kubernetes OpenAPI schema (strict), the
kustomization holds together, and each rank's pod environment, resolved the way the
kubelet resolves it, is a valid ``RefitConfig`` (``RefitConfig.from_env``) whose worker
command parses. Nothing here talks to a cluster; the schema check needs the
``kubernetes-validate`` package (it ships the schemas) and is skipped without it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_refit.cli import build_parser
from elastic_refit.cli._etcd import etcd_config
from elastic_refit.cli.worker_cmd import side_layout
from elastic_refit.layout import parse_parallelism
from elastic_refit.runtime.config import RefitConfig

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# Everything the manifests use is GA by then (the pod-index label came in 1.28).
KUBERNETES_VERSION = "1.30"
NAMESPACE = "elastic-refit"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
ROLES = ("trainer", "inference")
TEST_PASSWORD = "test-job-password"
TEST_ROOT_PASSWORD = "test-root-password"
# Keys of the Secrets the operator creates (README.md, "Secrets"); file keys become
# files under the Secret's mount.
SECRET_FILES = ("ca.crt", "tls.crt", "tls.key")


# --- reading the folder ------------------------------------------------------------------

def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


MANIFEST_FILES = sorted(p for p in K8S.rglob("*.y*ml") if p.name != "kustomization.yaml")
DOCUMENTS = [(path, index, doc) for path in MANIFEST_FILES for index, doc in enumerate(_load(path))]
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _doc_id(entry: tuple[Path, int, dict[str, Any]]) -> str:
    path, index, doc = entry
    return f"{path.relative_to(K8S)}#{index}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [doc for _, _, doc in DOCUMENTS if doc.get("kind") == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name} in deploy/k8s, found {len(matches)}"
    return matches[0]


def generated_configmaps() -> dict[str, dict[str, str]]:
    """The data of every ConfigMap kustomization.yaml generates (name before the hash)."""
    maps: dict[str, dict[str, str]] = {}
    for generator in KUSTOMIZATION.get("configMapGenerator", []):
        data = maps.setdefault(generator["name"], {})
        for literal in generator.get("literals", []):
            key, sep, value = literal.partition("=")
            assert sep, f"configMapGenerator {generator['name']}: literal {literal!r} has no '='"
            data[key] = value
        for entry in generator.get("files", []):
            key, sep, path = entry.partition("=")
            path = path if sep else key
            data[Path(key).name if not sep else key] = (K8S / path).read_text()
    return maps


def readme_secrets() -> dict[str, set[str]]:
    """Secret name -> its keys, from README.md's `kubectl create secret generic` commands."""
    text = (K8S / "README.md").read_text().replace("\\\n", " ")
    secrets: dict[str, set[str]] = {}
    for match in re.finditer(r"create secret generic (\S+)([^\n]*)", text):
        secrets[match.group(1)] = set(re.findall(r"--from-(?:literal|file)=([^=\s]+)=", match.group(2)))
    return secrets


def workload(role: str) -> dict[str, Any]:
    return find("StatefulSet", f"elastic-refit-{role}")


def container(pod_spec: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    listed = pod_spec.get("initContainers" if init else "containers", [])
    matches = [c for c in listed if c["name"] == name]
    assert len(matches) == 1, f"expected one container {name!r}, found {[c['name'] for c in listed]}"
    return matches[0]


def etcd_flags() -> dict[str, str]:
    etcd = container(find("StatefulSet", "elastic-refit-etcd")["spec"]["template"]["spec"], "etcd")
    flags: dict[str, str] = {}
    for arg in etcd["args"]:
        assert arg.startswith("--") and "=" in arg, f"etcd argument {arg!r}: write flags as --name=value"
        name, _, value = arg.partition("=")
        assert name not in flags, f"etcd flag {name} given twice"
        flags[name] = value
    return flags


def expected_etcd_endpoints() -> tuple[str, ...]:
    """host:port of every etcd member through the headless Service, as clients list them."""
    sts = find("StatefulSet", "elastic-refit-etcd")
    peer = find("Service", sts["spec"]["serviceName"])
    (client_port,) = [p["port"] for p in peer["spec"]["ports"] if p["name"] == "client"]
    return tuple(f"{sts['metadata']['name']}-{i}.{peer['metadata']['name']}:{client_port}"
                 for i in range(sts["spec"]["replicas"]))


# --- resolving a pod's environment as the kubelet does ----------------------------------

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (env values, command, args): a defined variable is
    replaced, an undefined one is left as written, $$ is a literal $."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(replace, text)


def fake_pod(role: str, ordinal: int) -> dict[str, Any]:
    sts = workload(role)
    name = f"{sts['metadata']['name']}-{ordinal}"
    labels = {**sts["spec"]["template"]["metadata"]["labels"], POD_INDEX_LABEL: str(ordinal),
              "statefulset.kubernetes.io/pod-name": name}
    return {"name": name, "namespace": NAMESPACE, "labels": labels, "nodeName": f"gpu-node-{ordinal // 8}",
            "podIP": f"10.244.{ordinal // 8}.{10 + ordinal}"}


def field_value(pod: dict[str, Any], path: str) -> str:
    simple = {"metadata.name": pod["name"], "metadata.namespace": pod["namespace"],
              "spec.nodeName": pod["nodeName"], "status.podIP": pod["podIP"]}
    if path in simple:
        return simple[path]
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if label:
        assert label.group(1) in pod["labels"], f"fieldRef {path}: the pod has no such label"
        return pod["labels"][label.group(1)]
    pytest.fail(f"fieldRef {path!r}: this test does not know what Kubernetes puts there")


def secret_values(job: str) -> dict[tuple[str, str], str]:
    return {("elastic-refit-etcd-job", "user"): job, ("elastic-refit-etcd-job", "password"): TEST_PASSWORD,
            ("elastic-refit-etcd-root", "password"): TEST_ROOT_PASSWORD}


def resolve_env(spec: dict[str, Any], pod_spec: dict[str, Any], pod: dict[str, Any],
                files: Path | None) -> dict[str, str]:
    """The container's environment for ``pod``: values expanded, fieldRefs from the fake
    pod, secretKeyRefs with test passwords, configMapKeyRefs from the generators. With
    ``files``, every ``*_FILE`` / ETCDCTL_* path into a mounted Secret is replaced by a
    real file of the same name under ``files`` (RefitConfig checks the files exist)."""
    configmaps = generated_configmaps()
    job = configmaps["elastic-refit-job"]["job"]
    secrets = secret_values(job)
    assert not spec.get("envFrom"), "envFrom is not resolved by this test"
    env: dict[str, str] = {}
    for var in spec.get("env", []):
        name = var["name"]
        assert name not in env, f"{name} is set twice"
        if "value" in var:
            env[name] = expand(str(var["value"]), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert (ref["name"], ref["key"]) in secrets, f"{name}: unknown Secret key {ref}"
            env[name] = secrets[(ref["name"], ref["key"])]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in configmaps, f"{name}: ConfigMap {ref['name']} is not generated"
            assert ref["key"] in configmaps[ref["name"]], f"{name}: ConfigMap {ref['name']} has no {ref['key']}"
            env[name] = configmaps[ref["name"]][ref["key"]]
        else:
            pytest.fail(f"{name}: valueFrom {sorted(source)} is not resolved by this test")
    if files is not None:
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in spec.get("volumeMounts", [])}
        for name, value in env.items():
            if not value.startswith("/") or not (name.endswith("_FILE") or name.startswith("ETCDCTL_")):
                continue
            mount = [path for path in mounts if value.startswith(path.rstrip("/") + "/")]
            assert mount, f"{name}={value} is not under any of the container's mounts {sorted(mounts)}"
            volume = mounts[mount[0]]
            assert "secret" in volume, f"{name}={value}: mounted from {volume}, expected a Secret"
            key = value[len(mount[0].rstrip("/")) + 1:]
            assert key in SECRET_FILES, f"{name}: {key!r} is not a key of {volume['secret']['secretName']}"
            real = files / volume["secret"]["secretName"] / key
            real.parent.mkdir(parents=True, exist_ok=True)
            real.write_text("-----BEGIN CERTIFICATE-----\nnot a real one\n-----END CERTIFICATE-----\n")
            env[name] = str(real)
    return env


# --- the schema --------------------------------------------------------------------------

@pytest.mark.parametrize("entry", DOCUMENTS, ids=_doc_id)
def test_every_manifest_matches_the_kubernetes_schema(entry):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate: the Kubernetes OpenAPI schemas, offline")
    path, _, doc = entry
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top)"
        pytest.fail(f"{_doc_id(entry)}: {where}: {exc.message}")
    assert "namespace" not in doc["metadata"], f"{path.name}: kustomization.yaml sets the namespace"


def test_the_kustomize_build_matches_the_schema_too():
    """What `kubectl apply -k` sends: the generated ConfigMaps, hashed names and labels."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate: the Kubernetes OpenAPI schemas, offline")
    if shutil.which("kustomize"):
        command = ["kustomize", "build", str(K8S)]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(K8S)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)} failed: {done.stderr}"
    built = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    for doc in built:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == KUSTOMIZATION["namespace"]
    kinds = sorted(doc["kind"] for doc in built)
    assert kinds.count("ConfigMap") == len(KUSTOMIZATION["configMapGenerator"])
    assert len(built) == len(DOCUMENTS) + kinds.count("ConfigMap")


# --- the kustomization -------------------------------------------------------------------

def test_the_kustomization_lists_every_manifest_and_what_it_generates_exists():
    k = KUSTOMIZATION
    assert k["kind"] == "Kustomization"
    resources = k["resources"]
    for resource in resources:
        assert (K8S / resource).is_file(), f"kustomization.yaml lists {resource}, which is not in deploy/k8s"
    assert sorted(resources) == sorted(str(p.relative_to(K8S)) for p in MANIFEST_FILES), \
        "every manifest in deploy/k8s is listed under resources, and nothing else"
    assert k["namespace"] == find("Namespace", k["namespace"])["metadata"]["name"] == NAMESPACE
    assert k["labels"] and all(entry["pairs"] for entry in k["labels"])
    for generator in k["configMapGenerator"]:
        for entry in generator.get("files", []):
            path = entry.partition("=")[2] or entry
            assert (K8S / path).is_file(), f"configMapGenerator {generator['name']}: {path} is not in deploy/k8s"
    images = {_image_name(c["image"]) for _, _, doc in DOCUMENTS if doc["kind"] in ("StatefulSet", "Job")
              for c in doc["spec"]["template"]["spec"].get("initContainers", [])
              + doc["spec"]["template"]["spec"]["containers"]}
    assert {image["name"] for image in k["images"]} == images, "an images: entry per image the manifests use"
    for entry in k["replicas"]:
        sts = find("StatefulSet", entry["name"])
        assert sts["spec"]["replicas"] == entry["count"], \
            f"{entry['name']}: replicas {sts['spec']['replicas']} in the manifest, {entry['count']} in kustomization.yaml"
    # The synthetic members' model is deploy/smoke-model.json (kustomize reads only files in its folder).
    assert json.loads((K8S / "smoke-model.json").read_text()) == \
        json.loads((ROOT / "deploy" / "smoke-model.json").read_text())


def test_every_secret_and_configmap_reference_exists():
    """ConfigMaps come from the generators; Secrets are the ones README.md creates, with their keys."""
    configmaps = generated_configmaps()
    secrets = readme_secrets()
    assert set(secrets) == {"elastic-refit-etcd-server-tls", "elastic-refit-etcd-client-tls",
                            "elastic-refit-etcd-root", "elastic-refit-etcd-job"}
    for _, _, doc in DOCUMENTS:
        if doc["kind"] not in ("StatefulSet", "Job"):
            continue
        pod_spec = doc["spec"]["template"]["spec"]
        for volume in pod_spec.get("volumes", []):
            if "secret" in volume:
                assert secrets.get(volume["secret"]["secretName"]) == set(SECRET_FILES), volume
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, volume
        for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
            for var in c.get("env", []):
                source = var.get("valueFrom", {})
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    assert ref["key"] in secrets.get(ref["name"], set()), f"{c['name']}: {var}"
                if "configMapKeyRef" in source:
                    ref = source["configMapKeyRef"]
                    assert ref["key"] in configmaps.get(ref["name"], {}), f"{c['name']}: {var}"
            mounted = {v["name"] for v in pod_spec.get("volumes", [])}
            mounted |= {claim["metadata"]["name"] for claim in doc["spec"].get("volumeClaimTemplates", [])}
            assert {m["name"] for m in c.get("volumeMounts", [])} <= mounted, c["name"]


# --- the ranks' environment --------------------------------------------------------------

@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("ordinal", [0, 1])
def test_each_ranks_environment_is_its_refit_config(role, ordinal, tmp_path):
    sts = workload(role)
    pod_spec = sts["spec"]["template"]["spec"]
    pod = fake_pod(role, ordinal)
    env = resolve_env(container(pod_spec, "member"), pod_spec, pod, tmp_path)

    known = {f"ELASTIC_REFIT_{name.upper()}" for name in RefitConfig.setting_names()}
    unknown = sorted(name for name in env if name.startswith("ELASTIC_REFIT_") and name not in known)
    assert not unknown, f"from_env ignores {unknown}: not RefitConfig fields"
    assert env["ELASTIC_REFIT_BIND_INTERFACE"] == "eth0"
    if "eth0" not in [name for _, name in socket.if_nameindex()]:
        # RefitConfig checks that the interface exists on the host it runs on: pods have
        # eth0, this machine may not. Its loopback stands in (the value still goes
        # through from_env's parsing).
        env["ELASTIC_REFIT_BIND_INTERFACE"] = "lo"

    config = RefitConfig.from_env(env)  # the same call the worker makes, with no overrides

    job = generated_configmaps()["elastic-refit-job"]["job"]
    assert config.job == job
    assert config.role == role
    assert config.member_id == pod["name"] == f"elastic-refit-{role}-{ordinal}"
    assert config.layout_rank == ordinal
    assert config.host == pod["podIP"] and config.domain == pod["nodeName"]
    assert (config.device, config.backend) == ("cuda:0", "nccl")
    assert config.etcd == expected_etcd_endpoints()
    assert config.etcd_ca_file == str(tmp_path / "elastic-refit-etcd-client-tls" / "ca.crt")
    assert config.etcd_cert_file == str(tmp_path / "elastic-refit-etcd-client-tls" / "tls.crt")
    assert config.etcd_key_file == str(tmp_path / "elastic-refit-etcd-client-tls" / "tls.key")
    assert (config.etcd_user, config.etcd_password) == (job, TEST_PASSWORD)
    assert not config.etcd_allow_plaintext_password
    etcd = config.etcd_config()
    assert etcd.tls and etcd.username == job and etcd.client_cert == config.etcd_cert_file
    assert config.collective_timeout_s < config.ttl_s < config.epoch_deadline_s
    assert config.incarnation  # not set by the pod: new on every container start


@pytest.mark.parametrize("role", ROLES)
def test_each_rank_runs_the_worker_for_its_side(role, tmp_path):
    sts = workload(role)
    pod_spec = sts["spec"]["template"]["spec"]
    member = container(pod_spec, "member")
    env = resolve_env(member, pod_spec, fake_pod(role, 0), tmp_path)
    assert member["command"][:2] == ["python3", "-c"] and len(member["command"]) == 3, "the signal wrapper"
    argv = [expand(arg, env) for arg in member["args"]]
    assert argv[0] == "elastic-refit" and "$(" not in " ".join(argv), argv

    args = build_parser().parse_args(argv[1:])

    parallelism = generated_configmaps()["elastic-refit-job"][f"{role}-parallelism"]
    assert (args.command, args.model, args.parallelism) == ("worker", "/config/smoke-model.json", parallelism)
    assert (args.versions, args.pause_s) == (100, 5.0)
    # /config is the generated model ConfigMap, and it holds the file.
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (config_mount,) = [m for m in member["volumeMounts"] if m["mountPath"] == "/config"]
    model_map = volumes[config_mount["name"]]["configMap"]["name"]
    assert Path(args.model).name in generated_configmaps()[model_map]
    # One pod per layout rank: replicas == the side's world size, and the layout builds.
    side = "training" if role == "trainer" else "inference"
    world = parse_parallelism(parallelism, side=side).world_size
    (count,) = [r["count"] for r in KUSTOMIZATION["replicas"] if r["name"] == sts["metadata"]["name"]]
    assert world == count == sts["spec"]["replicas"], f"{role}: {parallelism} has {world} ranks, {count} pods"
    side_layout(role, str(K8S / Path(args.model).name), parallelism, args.layers)


@pytest.mark.parametrize("role", ROLES)
def test_each_rank_waits_for_etcd_with_its_own_settings(role, tmp_path, monkeypatch):
    """The init container runs `elastic-refit status` with what the member will use."""
    pod_spec = workload(role)["spec"]["template"]["spec"]
    pod = fake_pod(role, 1)
    init = container(pod_spec, "wait-for-etcd", init=True)
    env = resolve_env(init, pod_spec, pod, tmp_path)
    member_env = resolve_env(container(pod_spec, "member"), pod_spec, pod, tmp_path)
    assert {k: member_env[k] for k in env} == env, "the init container's settings are the member's"
    argv = [expand(arg, env) for arg in init["args"]]
    assert argv[0] == "elastic-refit" and "$(" not in " ".join(argv), argv

    args = build_parser().parse_args(argv[1:])

    assert args.command == "status" and args.job == member_env["ELASTIC_REFIT_JOB"]
    monkeypatch.setenv("ELASTIC_REFIT_ETCD_PASSWORD", env["ELASTIC_REFIT_ETCD_PASSWORD"])
    etcd = etcd_config(args)
    assert etcd.endpoints == expected_etcd_endpoints()
    assert etcd.tls and etcd.username == member_env["ELASTIC_REFIT_ETCD_USER"] and etcd.password == TEST_PASSWORD


@pytest.mark.parametrize("role", ROLES)
def test_each_workload_has_a_gpu_per_rank_and_stable_identities(role):
    sts = workload(role)
    spec = sts["spec"]
    pod_spec = spec["template"]["spec"]
    member = container(pod_spec, "member")
    assert member["resources"]["limits"]["nvidia.com/gpu"] == 1, "one GPU per pod (ELASTIC_REFIT_DEVICE=cuda:0)"
    assert spec["podManagementPolicy"] == "Parallel"
    assert pod_spec["terminationGracePeriodSeconds"] > 0
    assert pod_spec["enableServiceLinks"] is False, "Service links would add ELASTIC_REFIT_ETCD_* variables"
    service = find("Service", spec["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_the_member_wrapper_forwards_sigterm_as_sigint_and_keeps_the_exit_status(tmp_path):
    """The kubelet's SIGTERM reaches the member as SIGINT (a clean leave: KeyboardInterrupt
    unwinds `with ElasticRefit`); the member's exit status is the container's."""
    command = container(workload("trainer")["spec"]["template"]["spec"], "member")["command"]
    assert command == container(workload("inference")["spec"]["template"]["spec"], "member")["command"]
    wrapper = [sys.executable, "-S", *command[1:]]  # python3 -c SCRIPT, then the args

    done = subprocess.run([*wrapper, sys.executable, "-S", "-c", "raise SystemExit(3)"], timeout=30)
    assert done.returncode == 3

    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import pathlib, sys, time
        try:
            pathlib.Path({str(ready)!r}).write_text("x")
            time.sleep(30)
        except KeyboardInterrupt:
            sys.exit(42)
        sys.exit(1)
    """)
    proc = subprocess.Popen([*wrapper, sys.executable, "-S", "-c", child])
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the wrapped child did not start"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 42
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- etcd -----------------------------------------------------------------------------------

def test_etcd_runs_three_members_with_tls_auth_compaction_and_a_quota():
    sts = find("StatefulSet", "elastic-refit-etcd")
    spec = sts["spec"]
    pod_spec = spec["template"]["spec"]
    etcd = container(pod_spec, "etcd")
    flags = etcd_flags()
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    # Clients: TLS, a client certificate signed by the CA (then user and password).
    assert flags["--listen-client-urls"].startswith("https://")
    assert flags["--advertise-client-urls"].startswith("https://")
    assert flags["--client-cert-auth"] == "true"
    # Peers: TLS both ways.
    assert flags["--listen-peer-urls"].startswith("https://")
    assert flags["--initial-advertise-peer-urls"].startswith("https://")
    assert flags["--peer-client-cert-auth"] == "true"
    # Every certificate file is in the mounted server Secret.
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["mountPath"]: volumes.get(m["name"]) for m in etcd["volumeMounts"]}
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file", "--peer-key-file",
                 "--peer-trusted-ca-file"):
        directory, _, key = flags[flag].rpartition("/")
        assert key in SECRET_FILES and mounts[directory]["secret"]["secretName"] == "elastic-refit-etcd-server-tls", flag
    # The member names: $(POD_NAME) through the headless Service, for all replicas.
    assert flags["--name"] == "$(POD_NAME)"
    peer_url = flags["--initial-advertise-peer-urls"]
    members = dict(entry.split("=", 1) for entry in flags["--initial-cluster"].split(","))
    assert members == {f"elastic-refit-etcd-{i}": peer_url.replace("$(POD_NAME)", f"elastic-refit-etcd-{i}")
                       for i in range(spec["replicas"])}
    assert f".{spec['serviceName']}." in peer_url
    defined = {var["name"] for var in etcd["env"]}
    assert set(re.findall(r"\$\(([A-Za-z_0-9]+)\)", " ".join(etcd["args"]))) <= defined
    # Authentication: the Job turns it on; tokens the members hold survive auth changes.
    assert flags["--auth-token"] == "simple"
    # History and size.
    assert flags["--auto-compaction-mode"] == "revision" and int(flags["--auto-compaction-retention"]) > 0
    quota = int(flags["--quota-backend-bytes"])
    (claim,) = spec["volumeClaimTemplates"]
    assert 0 < quota < _bytes(claim["spec"]["resources"]["requests"]["storage"])
    assert claim["metadata"]["name"] in {m["name"] for m in etcd["volumeMounts"]}
    assert flags["--data-dir"].startswith(next(m["mountPath"] for m in etcd["volumeMounts"]
                                               if m["name"] == claim["metadata"]["name"]))
    # Probes on the plain-HTTP metrics listener; requests for the scheduler.
    metrics_port = int(flags["--listen-metrics-urls"].rsplit(":", 1)[1])
    assert {p["name"]: p["containerPort"] for p in etcd["ports"]}["metrics"] == metrics_port
    for probe in ("livenessProbe", "readinessProbe"):
        assert etcd[probe]["httpGet"]["path"].startswith("/health") and etcd[probe]["httpGet"]["port"] == "metrics"
    assert {"cpu", "memory"} <= set(etcd["resources"]["requests"])


def test_the_etcd_services_and_the_disruption_budget_select_the_etcd_pods():
    sts = find("StatefulSet", "elastic-refit-etcd")
    etcd_labels = sts["spec"]["template"]["metadata"]["labels"]
    peer = find("Service", sts["spec"]["serviceName"])
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in peer["spec"]["ports"]} == {2379, 2380}
    client = find("Service", "elastic-refit-etcd")
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]
    pdb = find("PodDisruptionBudget", "elastic-refit-etcd")
    assert pdb["spec"]["maxUnavailable"] == 1
    for selector in (peer["spec"]["selector"], client["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= etcd_labels.items()
        others = [workload(role)["spec"]["template"]["metadata"]["labels"] for role in ROLES]
        others.append(find("Job", "elastic-refit-etcd-auth")["spec"]["template"]["metadata"]["labels"])
        assert not any(selector.items() <= labels.items() for labels in others), "selects more than etcd"


def _image_name(image: str) -> str:
    """An image reference without its tag or digest (what kustomize's images: matches)."""
    image = image.split("@", 1)[0]
    head, _, last = image.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()
    return int(number) * units.get(unit, 1)


# --- the auth Job, against a fake etcdctl -------------------------------------------------

FAKE_ETCDCTL = r'''
"""A stand-in for etcdctl: etcd's auth rules for the commands etcd-auth.sh uses, state in a JSON file."""
import json, os, sys
state_path = os.environ["FAKE_ETCD_STATE"]
state = json.load(open(state_path)) if os.path.exists(state_path) else {
    "users": {}, "roles": {}, "grants": {}, "auth": False, "calls": []}
argv = sys.argv[1:]
user, password = os.environ.get("ETCDCTL_USER", ""), os.environ.get("ETCDCTL_PASSWORD", "")
state["calls"].append({"argv": argv, "user": user})
def done(code=0, out=""):
    json.dump(state, open(state_path, "w"))
    sys.stdout.write(out)
    sys.exit(code)
for name in ("ETCDCTL_ENDPOINTS", "ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY"):
    if not os.environ.get(name):
        sys.stderr.write(f"{name} is not set\n"); done(3)
if state["auth"] and state["users"].get(user) != password:
    sys.stderr.write("Error: etcdserver: authentication failed, invalid user ID or password\n"); done(1)
def stdin_password():
    words = sys.stdin.read().split()
    return words[0] if words else ""
def permitted(key):
    if not state["auth"] or "root" in state["grants"].get(user, []):
        return True
    return any(key.startswith(prefix) for role in state["grants"].get(user, [])
               for _, prefix in state["roles"].get(role, []))
words = [a for a in argv if not a.startswith("--")]
verb = " ".join(words[:2])
if words[0] == "get":
    done(0 if permitted(words[1]) else 1)
if not state["auth"] or "root" in state["grants"].get(user, []):
    pass
else:
    sys.stderr.write("Error: etcdserver: permission denied\n"); done(1)
if verb == "user get":
    if words[2] not in state["users"]:
        done(1)
    done(0, f"User: {words[2]}\nRoles: {' '.join(state['grants'].get(words[2], []))}\n")
if verb in ("user add", "user passwd"):
    if ":" in words[2] or "--interactive=false" not in argv:
        sys.stderr.write("the password must come from stdin\n"); done(4)
    if (verb == "user add") == (words[2] in state["users"]):
        done(1)
    state["users"][words[2]] = stdin_password(); done()
if verb == "user grant-role":
    if words[2] not in state["users"] or (words[3] != "root" and words[3] not in state["roles"]):
        done(1)
    roles = state["grants"].setdefault(words[2], [])
    if words[3] not in roles:
        roles.append(words[3])
    done()
if verb == "role get":
    if words[2] not in state["roles"]:
        done(1)
    lines = [f"Role {words[2]}", "KV Read:"]
    lines += [f"\t[{p}, {p[:-1]}0) (prefix {p})" for kind, p in state["roles"][words[2]] if "read" in kind]
    lines += ["KV Write:"]
    lines += [f"\t[{p}, {p[:-1]}0) (prefix {p})" for kind, p in state["roles"][words[2]] if "write" in kind]
    done(0, "\n".join(lines) + "\n")
if verb == "role add":
    if words[2] in state["roles"]:
        done(1)
    state["roles"][words[2]] = []; done()
if verb == "role grant-permission":
    if words[2] not in state["roles"] or "--prefix=true" not in argv:
        done(1)
    state["roles"][words[2]].append([words[3], words[4]]); done()
if verb == "auth enable":
    if "root" not in state["grants"].get("root", []):
        sys.stderr.write("Error: etcdserver: root user does not have root role\n"); done(1)
    state["auth"] = True; done()
sys.stderr.write(f"fake etcdctl: unexpected command {argv}\n"); done(2)
'''

MUTATING = ("user add", "user passwd", "user grant-role", "role add", "role grant-permission", "auth enable")


def test_the_auth_job_gives_the_job_a_user_on_its_prefix_only_and_can_run_again(tmp_path):
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh on this machine")
    job = find("Job", "elastic-refit-etcd-auth")
    pod_spec = job["spec"]["template"]["spec"]
    etcdctl = container(pod_spec, "etcdctl")
    # The Job runs the generated script from its ConfigMap volume.
    shell, script_path = etcdctl["command"]
    assert shell == "/bin/sh"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (mount,) = [m for m in etcdctl["volumeMounts"] if script_path.startswith(m["mountPath"].rstrip("/") + "/")]
    script_map = volumes[mount["name"]]["configMap"]["name"]
    script = generated_configmaps()[script_map][Path(script_path).name]
    # Its etcdctl talks to the same etcd members as the ranks, over TLS with the client Secret.
    env = resolve_env(etcdctl, pod_spec, {"name": "auth", "namespace": NAMESPACE, "labels": {},
                                          "nodeName": "n", "podIP": "10.0.0.1"}, tmp_path)
    assert tuple(e.removeprefix("https://") for e in env["ETCDCTL_ENDPOINTS"].split(",")) == \
        expected_etcd_endpoints()
    assert all(e.startswith("https://") for e in env["ETCDCTL_ENDPOINTS"].split(","))
    assert "elastic-refit-etcd-client-tls" in env["ETCDCTL_CERT"]

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "etcdctl"
    fake.write_text(f"#!{sys.executable} -S\n{FAKE_ETCDCTL}")
    fake.chmod(0o755)
    (tmp_path / "etcd-auth.sh").write_text(script)
    state_path = tmp_path / "state.json"
    run_env = {**env, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               "FAKE_ETCD_STATE": str(state_path)}

    def run(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sh, str(tmp_path / "etcd-auth.sh")], env={**run_env, **extra},
                              capture_output=True, text=True, timeout=60)

    first = run()
    assert first.returncode == 0, first.stderr
    state = json.loads(state_path.read_text())
    name = env["JOB"]
    assert state["auth"] is True
    assert state["users"] == {"root": TEST_ROOT_PASSWORD, env["JOB_USER"]: TEST_PASSWORD}
    assert state["roles"] == {f"{name}-rw": [["readwrite", f"/elastic-refit/{name}/"]]}
    assert state["grants"] == {"root": ["root"], env["JOB_USER"]: [f"{name}-rw"]}
    calls = [" ".join(c["argv"]) for c in state["calls"]]
    assert not [c for c in calls if TEST_PASSWORD in c or TEST_ROOT_PASSWORD in c], "a password on a command line"
    verbs = [" ".join([w for w in c["argv"] if not w.startswith("--")][:2]) for c in state["calls"]]
    assert verbs.index("auth enable") > max(i for i, v in enumerate(verbs) if v.startswith(("user", "role")))
    # It checked, as the job's user, its prefix (allowed) and the level above (refused).
    as_job = [c["argv"] for c in state["calls"] if c["user"] == env["JOB_USER"]]
    assert [a[-1] for a in as_job] == [f"/elastic-refit/{name}/", "/elastic-refit/"]

    count = len(state["calls"])
    again = run()
    assert again.returncode == 0, again.stderr
    state = json.loads(state_path.read_text())
    repeated = [" ".join(w for w in c["argv"] if not w.startswith("--")) for c in state["calls"][count:]]
    # Nothing changes the second time (etcd ignores granting a held role and enabling auth twice).
    changed = [c for c in repeated if c.startswith(MUTATING) and not c.startswith(("user grant-role", "auth enable"))]
    assert not changed, repeated

    wrong = run(ROOT_PASSWORD="not-the-root-password")
    assert wrong.returncode != 0 and "retries" in wrong.stderr

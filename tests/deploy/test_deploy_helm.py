"""deploy/helm/stockade: rendered by Helm's own engine (helm-python-sdk), every object
validated with kubernetes-validate against each Kubernetes version the chart claims,
linted, and the values that change what renders (pools, tiers, Vault auth) checked one
by one. No cluster can run here: the rendered config is loaded by stockade.config and the
rules ConfigMap, projected as the kubelet does, by the rules loader."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from configmap_volume import project
from deploy_support import DEPLOY, REPO, parse_unit, unit_value
from stockade.policy import load_rules

from stockade.config import load_config

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) not installed")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")

CHART = DEPLOY / "helm" / "stockade"
RULES = REPO / "rules"
LAUNCHER_UNIT = DEPLOY / "systemd" / "stockade-launcher.service"
Doc = dict[str, Any]


def repo_rules() -> dict[str, str]:
    return {str(p.relative_to(RULES)): p.read_text() for p in sorted(RULES.rglob("*"))
            if p.is_file()}


API = {"tokenSecret": "stockade-launcher-token", "tlsSecret": "stockade-launcher-tls"}
BASE: dict[str, Any] = {"vault": {"address": "https://vault.example.internal:8200"},
                        "rules": {"files": repo_rules()}, "launcher": {"api": API}}


def values(**over: Any) -> dict[str, Any]:
    """BASE with `over` merged in (one level: a given section replaces BASE's keys in it)."""
    out = copy.deepcopy(BASE)
    for key, val in over.items():
        out[key] = {**out[key], **val} if isinstance(val, dict) and key in out else val
    return out


def render(vals: dict[str, Any]) -> list[Doc]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=vals, name="stk", namespace="stockade-system")
    docs = [d for name, text in sorted(out.items()) if not name.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    assert docs
    return docs


def render_error(vals: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmError) as ei:
        render(vals)
    return str(ei.value)


def kinds(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Doc], kind: str) -> Doc:
    found = kinds(docs, kind)
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def containers(ds: Doc) -> dict[str, Doc]:
    return {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}


def pool_config(docs: list[Doc], pool: str, tmp_path: Path, key: str = "stockade.yaml"
                ) -> Any:
    """The pool's stockade.yaml (or launcher.yaml), loaded by stockade.config (strict:
    unknown keys fail)."""
    cm = next(d for d in kinds(docs, "ConfigMap")
              if d["metadata"]["name"] == f"stk-stockade-{pool}-config")
    path = tmp_path / f"{pool}-{key}"
    path.write_text(cm["data"][key])
    return load_config(path)


def supported_versions() -> list[str]:
    """Every Kubernetes minor from the chart's kubeVersion floor to the newest schema
    kubernetes-validate ships."""
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    low = int(re.search(r"1\.(\d+)", floor).group(1))  # type: ignore[union-attr]
    schemas = Path(kv.__file__).parent / "kubernetes-json-schema"
    minors = sorted(int(m.group(1)) for n in os.listdir(schemas)
                    if (m := re.fullmatch(r"v1\.(\d+)\.0-local-strict", n)))
    versions = [f"1.{m}.0" for m in minors if m >= low]
    assert len(versions) >= 5, versions
    return versions


VARIANTS = {
    "defaults": values(),
    "pools-and-tiers": values(pools=[
        {"name": "gvisor", "nodeSelector": {"stockade.io/sandbox-node": "gvisor"},
         "tiers": ["container", "gvisor"], "addressPool": "10.213.0.0/16"},
        {"name": "vm", "nodeSelector": {"stockade.io/sandbox-node": "vm"},
         "tolerations": [{"key": "stockade.io/sandbox", "operator": "Exists",
                          "effect": "NoSchedule"}],
         "tiers": ["container", "microvm"], "kvm": True, "addressPool": "10.214.0.0/16",
         "resources": {"launcher": {"requests": {"cpu": "500m", "memory": "256Mi"},
                                    "limits": {"cpu": "4", "memory": "2Gi"}}}},
    ]),
    "token-auth": values(vault={"auth": "token", "token": {"secret": "vault-token"},
                                "caSecret": "vault-ca"}),
    "approle-auth": values(vault={"auth": "approle",
                                  "approle": {"secret": "vault-approle", "mount": "approle"}}),
    "privileged": values(launcher={"privileged": True},
                         authProxy={"tlsSecret": "stockade-authproxy-tls"}),
    "mtls": values(launcher={"api": {**API, "clientCertificates": True}}),
    "plaintext-api": values(launcher={"api": {"tokenSecret": "t", "plaintext": True}}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_is_valid_for_every_supported_version(variant: str) -> None:
    docs = render(VARIANTS[variant])
    for version in supported_versions():
        for doc in docs:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']} on "
                            f"Kubernetes {version}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_is_clean(variant: str) -> None:
    for version in (supported_versions()[0], supported_versions()[-1]):
        report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace="stockade-system",
                           kube_version=f"v{version}")
        bad = [m for m in report["messages"] if m["severity"] >= 2]
        assert not bad and not report["errors"], (version, bad, report["errors"])


def test_bad_values_fail_with_a_clear_message() -> None:
    assert "rules.files is empty" in render_error({"vault": BASE["vault"]})
    assert "vault.address is required" in render_error({"rules": BASE["rules"]})
    assert "is not a relative path" in render_error(
        values(rules={"files": {"profiles/../../etc/passwd": "x"}}))
    assert "is not a relative path" in render_error(
        values(rules={"files": {"..data/x.yaml": "x"}}))
    assert "set vault.token.secret" in render_error(values(vault={"auth": "token"}))
    assert "set vault.approle.secret" in render_error(values(vault={"auth": "approle"}))
    pool = {"name": "a", "nodeSelector": {"x": "y"}, "tiers": ["container"],
            "addressPool": "10.213.0.0/16"}
    assert 'the name "a" is used twice' in render_error(values(pools=[pool, pool]))
    assert "must include container" in render_error(
        values(pools=[{**pool, "tiers": ["gvisor"]}]))
    assert "at least one node pool" in render_error(values(pools=[]))
    # the launcher API never listens without its token, nor (unasked) without TLS
    assert "launcher.api.tokenSecret is required" in render_error(
        values(launcher={"api": {"tlsSecret": "x"}}))
    assert "launcher.api.tlsSecret is empty" in render_error(
        values(launcher={"api": {"tokenSecret": "t"}}))
    assert "clientCertificates needs launcher.api.tlsSecret" in render_error(values(
        launcher={"api": {"tokenSecret": "t", "plaintext": True, "clientCertificates": True}}))
    kvm = {**pool, "tiers": ["container", "microvm"], "kvm": True}
    assert "gets /dev/kvm only through kvmResource" in render_error(
        values(pools=[kvm], kvmResource=""))
    assert render(values(pools=[kvm], kvmResource="", launcher={"privileged": True}))
    # (Helm's lint runs `fail` leniently, so these refusals are install-time: render)
    # values.schema.json: a misspelt key, a value outside its set, a bad pool name
    assert "additional properties 'vualt' not allowed" in render_error(values(vualt={}))
    assert "value must be one of 'kubernetes', 'token', 'approle'" in render_error(
        values(vault={"auth": "userpass"}))
    assert "/pools/0/name" in render_error(values(pools=[{**pool, "name": "Pool_A"}]))
    assert "/pools/0/tiers/1" in render_error(
        values(pools=[{**pool, "tiers": ["container", "firecracker"]}]))


def test_daemonset_shape_and_per_container_security() -> None:
    docs = render(values())
    ds = one(docs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["nodeSelector"] == {"stockade.io/sandbox-node": "true"}
    c = containers(ds)
    assert set(c) == {"gateway", "broker", "launcher", "auth-gateway-metrics",
                      "auth-broker-metrics"}
    for name in ("gateway", "broker"):
        sc = c[name]["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert c[name]["command"][:3] == ["stockade", name, "serve"]
    assert "privileged" not in c["launcher"]["securityContext"]
    assert c["launcher"]["command"][:3] == ["stockade", "launcher", "serve"]
    mounts = {m["name"]: m["mountPath"] for m in c["launcher"]["volumeMounts"]}
    assert mounts["cgroup"] == "/sys/fs/cgroup"
    for name, container in c.items():
        res = container["resources"]
        assert res["requests"] and res["limits"], name
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["cgroup"]["hostPath"] == {"path": "/sys/fs/cgroup", "type": "Directory"}
    # the rules volume has no subPath anywhere: the kubelet's swap must reach the pods
    assert not any("subPath" in m for ct in c.values() for m in ct.get("volumeMounts", []))


def test_launcher_capabilities_are_the_units() -> None:
    """By default the launcher has exactly the systemd unit's bounding set: not
    privileged, /proc/sys left masked (it mounts a procfs of its own), no escalation."""
    ds = one(render(values()), "DaemonSet")
    sc = containers(ds)["launcher"]["securityContext"]
    unit = parse_unit(LAUNCHER_UNIT)
    caps = {c.removeprefix("CAP_")
            for c in (unit_value(unit, "Service", "CapabilityBoundingSet") or "").split()}
    assert sc["capabilities"]["drop"] == ["ALL"] and set(sc["capabilities"]["add"]) == caps
    assert "privileged" not in sc and "procMount" not in sc
    assert sc["allowPrivilegeEscalation"] is False
    assert yaml.safe_load((CHART / "values.yaml").read_text())["launcher"]["privileged"] is False
    # privileged only when asked for
    ds = one(render(VARIANTS["privileged"]), "DaemonSet")
    assert containers(ds)["launcher"]["securityContext"]["privileged"] is True


def test_pools_and_tiers_render_one_daemonset_each() -> None:
    docs = render(VARIANTS["pools-and-tiers"])
    ds = {d["metadata"]["name"]: d for d in kinds(docs, "DaemonSet")}
    assert set(ds) == {"stk-stockade-gvisor", "stk-stockade-vm"}
    assert {d["metadata"]["name"] for d in kinds(docs, "PodDisruptionBudget")} == set(ds)
    vm = ds["stk-stockade-vm"]["spec"]["template"]["spec"]
    assert vm["nodeSelector"] == {"stockade.io/sandbox-node": "vm"}
    assert vm["tolerations"][0]["key"] == "stockade.io/sandbox"
    launcher = containers(ds["stk-stockade-vm"])["launcher"]
    assert launcher["resources"]["limits"]["devices.kubevirt.io/kvm"] == "1"
    assert launcher["resources"]["requests"]["cpu"] == "500m"
    gv = containers(ds["stk-stockade-gvisor"])["launcher"]["resources"]
    assert "devices.kubevirt.io/kvm" not in gv["limits"]
    # the selectors do not overlap: each pool's pods are its own
    sel = {n: d["spec"]["selector"]["matchLabels"]["stockade.io/pool"] for n, d in ds.items()}
    assert sorted(sel.values()) == ["gvisor", "vm"]


def test_pool_configs_load_and_follow_tiers(tmp_path: Path) -> None:
    docs = render(VARIANTS["pools-and-tiers"])
    gv, vm = (pool_config(docs, p, tmp_path) for p in ("gvisor", "vm"))
    assert gv.launcher.gvisor.enabled and not gv.launcher.microvm.enabled
    assert vm.launcher.microvm.enabled and vm.launcher.microvm.accel == "kvm"
    assert not vm.launcher.gvisor.enabled
    assert (gv.launcher.address_pool, vm.launcher.address_pool) == ("10.213.0.0/16",
                                                                    "10.214.0.0/16")
    for cfg in (gv, vm):
        # events go to stdout, for the node's log agent; metrics stay on loopback
        assert cfg.events.stdout and cfg.events.file is None
        assert cfg.gateway.metrics_listen.startswith("127.0.0.1:")
        assert cfg.broker.metrics_listen.startswith("127.0.0.1:")
    # the root launcher's event files are its own (a root-created 0640 file in the shared
    # directory would lock the uid-65534 services out); all else is the pool's config
    launcher = pool_config(docs, "vm", tmp_path, "launcher.yaml")
    assert launcher.events.stdout
    assert Path(launcher.events_file).parent != Path(vm.events_file).parent
    assert Path(launcher.task_events_dir) != Path(vm.task_events_dir)
    # ... and its API's TCP listener (the token is the launcher's alone)
    api = {"control_listen", "control_token_file", "control_tls_cert", "control_tls_key",
           "control_tls_client_ca"}
    assert vm.launcher.control_listen is None and vm.launcher.control_token_file is None
    assert launcher.model_dump(exclude={"events", "launcher"}) == vm.model_dump(
        exclude={"events", "launcher"})
    assert launcher.launcher.model_dump(exclude=api) == vm.launcher.model_dump(exclude=api)
    ds = next(d for d in kinds(docs, "DaemonSet") if d["metadata"]["name"] == "stk-stockade-vm")
    c = containers(ds)
    assert c["launcher"]["command"][-1] == "/etc/stockade/config/launcher.yaml"
    assert c["gateway"]["command"][-1] == c["broker"]["command"][-1] == (
        "/etc/stockade/config/stockade.yaml")


@pytest.mark.parametrize(("variant", "mode", "volume_kind"), [
    ("defaults", "kubernetes", "projected"), ("token-auth", "token", "secret"),
    ("approle-auth", "approle", "secret")])
def test_vault_auth_modes(variant: str, mode: str, volume_kind: str, tmp_path: Path) -> None:
    docs = render(VARIANTS[variant])
    cfg = pool_config(docs, "sandbox", tmp_path)
    assert cfg.vault.auth == mode and cfg.vault.auth_mode == mode
    ds = one(docs, "DaemonSet")
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    creds = vols["vault-credentials"]
    assert volume_kind in creds
    broker = {m["name"]: m["mountPath"] for m in containers(ds)["broker"]["volumeMounts"]}
    for name in ("gateway", "launcher"):  # only the broker sees Vault credentials
        assert "vault-credentials" not in {m["name"]
                                           for m in containers(ds)[name]["volumeMounts"]}
    base = broker["vault-credentials"]
    if mode == "kubernetes":
        src = creds["projected"]["sources"][0]["serviceAccountToken"]
        assert src["audience"] == "vault" and src["path"] == "token"
        assert cfg.vault.kubernetes.token_file == f"{base}/token"
        assert cfg.vault.kubernetes.role == "stockade-broker"
    elif mode == "token":
        assert creds["secret"]["secretName"] == "vault-token"
        assert cfg.vault.token_file == f"{base}/token"
        assert cfg.vault.ca_file == f"{broker['vault-ca']}/ca.crt"
    else:
        assert {i["path"] for i in creds["secret"]["items"]} == {"role-id", "secret-id"}
        assert cfg.vault.approle.role_id_file == f"{base}/role-id"


def test_rules_configmap_projects_back_to_the_repository(tmp_path: Path) -> None:
    docs = render(values())
    cm = next(d for d in kinds(docs, "ConfigMap") if d["metadata"]["name"] == "stk-stockade-rules")
    assert all("/" not in key for key in cm["data"])
    ds = one(docs, "DaemonSet")
    vol = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "rules")
    items = vol["configMap"]["items"]
    assert {i["key"] for i in items} == set(cm["data"])
    # what the kubelet makes of it loads as the repository's rules do
    project(tmp_path / "rules", {i["path"]: cm["data"][i["key"]].encode() for i in items})
    assert load_rules(tmp_path / "rules").version == load_rules(RULES).version


def test_control_ports_service_and_networkpolicy() -> None:
    docs = render(values())
    ports = yaml.safe_load((CHART / "values.yaml").read_text())["ports"]
    control = {ports[k] for k in ("gatewayMetricsAuth", "brokerMetricsAuth", "launcherApi")}
    svc = one(docs, "Service")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in svc["spec"]["ports"]} == control
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == control
    np_ = one(docs, "NetworkPolicy")
    assert np_["spec"]["policyTypes"] == ["Ingress"]
    rule = np_["spec"]["ingress"][0]
    assert {p["port"] for p in rule["ports"]} == control
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
        "stockade.io/control-plane": "true"}}, "podSelector": {}}]
    ds = one(docs, "DaemonSet")
    c = containers(ds)
    proxies = [ct for n, ct in c.items() if n.startswith("auth-")]
    assert {ct["ports"][0]["containerPort"] for ct in proxies} == control - {
        ports["launcherApi"]}
    for ct in proxies:  # the metrics' upstreams are loopback only
        upstream = next(a for a in ct["args"] if a.startswith("--upstream="))
        assert upstream in (f"--upstream=http://127.0.0.1:{ports['gatewayMetrics']}/",
                            f"--upstream=http://127.0.0.1:{ports['brokerMetrics']}/")
    # the launcher serves its API itself: the Service's launcher-api is its port
    assert c["launcher"]["ports"] == [{"name": "launcher-api", "protocol": "TCP",
                                       "containerPort": ports["launcherApi"]}]
    role = next(d for d in kinds(docs, "Role") if d["metadata"]["name"].endswith("-client"))
    assert role["rules"][0]["resources"] == ["services/proxy"]


def test_no_unauthenticated_bridge_to_the_launcher() -> None:
    """No socat (nor anything else) copies the root-only socket to a port: the only
    containers mounting /run/stockade are the three services, and no command or argument
    names the launcher's socket but the launcher's own readiness probe."""
    for variant in VARIANTS.values():
        ds = kinds(render(variant), "DaemonSet")
        for d in ds:
            c = containers(d)
            text = yaml.safe_dump({n: {k: v for k, v in ct.items() if k != "readinessProbe"}
                                   for n, ct in c.items()})
            assert "socat" not in text and "launcher.sock" not in text
            assert "UNIX-CONNECT" not in text
            run = {n for n, ct in c.items()
                   if any(m["name"] == "run" for m in ct.get("volumeMounts", []))}
            assert run == {"gateway", "broker", "launcher"}


@pytest.mark.parametrize("variant", ["defaults", "mtls", "plaintext-api"])
def test_launcher_api_token_secret_is_wired(variant: str, tmp_path: Path) -> None:
    """The Secret's token reaches the launcher alone, mode 0400, at the file its config
    names; TLS and client certificates follow the values."""
    docs = render(VARIANTS[variant])
    api = VARIANTS[variant]["launcher"]["api"]
    ds = one(docs, "DaemonSet")
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    secret = vols["launcher-api-token"]["secret"]
    assert secret == {"secretName": api["tokenSecret"], "defaultMode": 0o400,
                      "items": [{"key": "token", "path": "token"}]}
    c = containers(ds)
    holders = {n: m["mountPath"] for n, ct in c.items() for m in ct.get("volumeMounts", [])
               if m["name"] in ("launcher-api-token", "launcher-api-tls")}
    assert set(holders) == {"launcher"}
    mounts = {m["name"]: m for m in c["launcher"]["volumeMounts"]}
    cfg = pool_config(docs, "sandbox", tmp_path, "launcher.yaml").launcher
    port = yaml.safe_load((CHART / "values.yaml").read_text())["ports"]["launcherApi"]
    assert cfg.control_listen == f"0.0.0.0:{port}"
    token_dir = mounts["launcher-api-token"]["mountPath"]
    assert mounts["launcher-api-token"]["readOnly"] is True
    # through ..data, the directory the kubelet swaps (test_deploy_helm_launcher_api.py
    # serves the API with this very config and a Secret laid out as the kubelet does)
    assert cfg.control_token_file == f"{token_dir}/..data/token"
    if api.get("tlsSecret"):
        tls = vols["launcher-api-tls"]["secret"]
        assert tls["secretName"] == api["tlsSecret"] and tls["defaultMode"] == 0o400
        tls_dir = mounts["launcher-api-tls"]["mountPath"]
        assert (cfg.control_tls_cert, cfg.control_tls_key) == (f"{tls_dir}/tls.crt",
                                                               f"{tls_dir}/tls.key")
        want_ca = f"{tls_dir}/ca.crt" if api.get("clientCertificates") else None
        assert cfg.control_tls_client_ca == want_ca
        assert {i["key"] for i in tls["items"]} == {"tls.crt", "tls.key"} | (
            {"ca.crt"} if want_ca else set())
    else:
        assert "launcher-api-tls" not in vols and cfg.control_tls_cert is None


def test_every_value_is_documented() -> None:
    """Each top-level key of values.yaml has a comment there and a row in docs/deploy.md."""
    text = (CHART / "values.yaml").read_text()
    doc = (REPO / "docs" / "deploy.md").read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([A-Za-z]+):", line)
        if not m:
            continue
        key = m.group(1)
        commented = "#" in line or (i > 0 and lines[i - 1].startswith("#")) or any(
            nxt.strip().startswith("#") for nxt in lines[i + 1:i + 2])
        assert commented, f"values.yaml: {key} has no comment"
        assert f"`{key}" in doc, f"docs/deploy.md does not describe the value {key}"

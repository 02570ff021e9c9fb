"""The launcher API as the chart configures it, served for real: the rendered launcher.yaml
(its listener, its token file through the kubelet's `..data`, TLS from a kubernetes.io/tls
Secret) loaded by stockade.config and started by `LauncherService`, with the Secrets laid
out as the kubelet projects them (mode 0400, the defaultMode the chart sets). Requests
without the token, or with a wrong one, are refused; a rotated Secret takes over without a
restart; with clientCertificates a client without a certificate cannot connect."""

from __future__ import annotations

import os
import secrets
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from configmap_volume import project
from test_deploy_helm import API, containers, kinds, one, render, values

from stockade.config import load_config
from stockade.ports import free_port

trustme = pytest.importorskip("trustme")
pytestmark = [pytest.mark.netns, pytest.mark.skipif(os.geteuid() != 0,
                                                    reason="needs root (nftables, mounts)")]


def _secret_volume(root: Path, mount: str, files: dict[str, bytes]) -> None:
    """A Secret volume at `root`+`mount`, as the kubelet writes one with defaultMode 0400."""
    vol = root / mount.lstrip("/")
    project(vol, files)
    for name in files:
        (vol / "..data" / name).resolve().chmod(0o400)


def _launcher_config(vals: dict[str, Any], tmp: Path) -> tuple[Any, Path]:
    """The chart's launcher.yaml with the node's paths and host-wide names moved under
    `tmp` (this host runs other launchers); the API's settings stay the chart's, re-rooted."""
    docs = render(vals)
    cm = next(d for d in kinds(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config"))
    cfg = yaml.safe_load(cm["data"]["launcher.yaml"])
    ds = one(docs, "DaemonSet")
    mounts = {m["name"]: m["mountPath"] for m in containers(ds)["launcher"]["volumeMounts"]}
    root = tmp / "pod"
    sfx = secrets.token_hex(3)
    lc = cfg["launcher"]
    port = free_port()
    assert lc["control_listen"].startswith("0.0.0.0:")
    lc["control_listen"] = f"0.0.0.0:{port}"
    for key in ("control_token_file", "control_tls_cert", "control_tls_key",
                "control_tls_client_ca"):
        if lc.get(key):
            lc[key] = str(root / lc[key].lstrip("/"))
    lc.update(control_socket=str(tmp / "run" / "launcher.sock"), scratch_dir=str(tmp / "sbx"),
              nft_table=f"stockade_ha{sfx}", cgroup_parent=f"stockade_ha{sfx}",
              name_prefix=f"h{sfx[:3]}", nflog_group=7700 + secrets.randbelow(99),
              address_pool=f"10.218.{100 + secrets.randbelow(100)}.0/24")
    lc["gvisor"]["root_dir"] = str(tmp / "run" / "runsc")
    (tmp / "rules" / "profiles").mkdir(parents=True)
    (tmp / "rules" / "profiles" / "p.yaml").write_text(
        "profile: p\ndescription: the API test\nisolation: container\negress:\n  mode: enforce\n")
    cfg.update(rules_dir=str(tmp / "rules"), state_dir=str(tmp / "state"),
               run_dir=str(tmp / "run"), log_dir=str(tmp / "log"))
    cfg["events"].update(file=str(tmp / "log" / "launcher" / "events.jsonl"),
                         task_dir=str(tmp / "log" / "launcher" / "tasks"), stdout=False)
    for sect in ("gateway", "broker"):
        cfg[sect]["control_socket"] = str(tmp / "run" / f"{sect}.sock")
    path = tmp / "launcher.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # the token file is in the launcher's own Secret mount (re-rooted)
    assert lc["control_token_file"].startswith(str(root) + mounts["launcher-api-token"] + "/")
    return load_config(path), root


class Served:
    def __init__(self, config: Any, root: Path, mounts: dict[str, str], ca: Any,
                 client: Any) -> None:
        self.config, self.root, self.mounts, self.ca = config, root, mounts, ca
        self.client = client  # the orchestrator's certificate (mTLS), or None
        self.port = int(config.launcher.control_listen.rsplit(":", 1)[1])

    async def call(self, token: str | None, client_cert: Any = None,
                   scheme: str = "https") -> tuple[int, Any]:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        if client_cert is not None:
            client_cert.configure_cert(ctx)
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        url = f"{scheme}://127.0.0.1:{self.port}/v1/sandboxes"
        async with aiohttp.ClientSession() as s, s.get(
                url, headers=headers, ssl=ctx if scheme == "https" else False) as resp:
            return resp.status, await resp.json(content_type=None)

    def rotate(self, token: bytes) -> None:
        _secret_volume(self.root, self.mounts["launcher-api-token"], {"token": token})


@pytest.fixture(params=["tls", "mtls"])
async def served(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Served]:
    from stockade.launcher.cgroups import remove_parent
    from stockade.launcher.service import LauncherService

    mtls = request.param == "mtls"
    vals = values(launcher={"api": {**API, "clientCertificates": mtls}})
    config, root = _launcher_config(vals, tmp_path)
    ds = one(render(vals), "DaemonSet")
    mounts = {m["name"]: m["mountPath"] for m in containers(ds)["launcher"]["volumeMounts"]}
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    tls = {"tls.crt": b"".join(b.bytes() for b in cert.cert_chain_pems),
           "tls.key": cert.private_key_pem.bytes()}
    if mtls:
        tls["ca.crt"] = ca.cert_pem.bytes()
    _secret_volume(root, mounts["launcher-api-tls"], tls)
    _secret_volume(root, mounts["launcher-api-token"], {"token": b"chart-token-1\n"})
    svc = LauncherService(config)
    await svc.start()
    try:
        yield Served(config, root, mounts, ca,
                     ca.issue_cert("orchestrator.example") if mtls else None)
    finally:
        await svc.stop()
        remove_parent(config.launcher.cgroup_root, config.launcher.cgroup_parent)


async def test_missing_and_wrong_tokens_are_refused(served: Served) -> None:
    client = served.client
    for token in (None, "", "wrong", "chart-token-1x", "chart-token"):
        status, body = await served.call(token, client)
        assert status == 401 and body["error"] == "unauthorized", token
    status, body = await served.call("chart-token-1", client)
    assert status == 200, body
    # a rotated Secret (the kubelet's ..data swap) takes over without a restart
    served.rotate(b"chart-token-2\n")
    assert (await served.call("chart-token-1", client))[0] == 401
    assert (await served.call("chart-token-2", client))[0] == 200


@pytest.mark.parametrize("served", ["mtls"], indirect=True)
async def test_client_certificate_required_with_mtls(served: Served) -> None:
    with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
        await served.call("chart-token-1")
    assert (await served.call("chart-token-1", served.client))[0] == 200


async def test_plaintext_gets_no_answer_on_the_tls_listener(served: Served) -> None:
    with pytest.raises(aiohttp.ClientError):
        await served.call("chart-token-1", scheme="http")

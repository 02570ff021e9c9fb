"""`egress.proxy_env`: the sandbox's environment (pure) and the refusal when the gateway's
explicit proxy listens on loopback only (real launcher, nothing created). The traffic path
through the real gateway is in `test_launcher_stack.py`."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from stockade.launcher import Launcher, LauncherError, SandboxSpec
from stockade.launcher.environment import PROXY_ENV_NAMES, proxy_listen_problem
from stockade.policy.model import Limits, Profile

from stockade.config import Config

from .conftest import Lab


def _launcher(tmp_path: Path, proxy_listen: list[str]) -> Launcher:
    cfg = Config.model_validate({
        "state_dir": str(tmp_path / "state"), "log_dir": str(tmp_path / "log"),
        "run_dir": str(tmp_path / "run"),
        "gateway": {"proxy_listen": proxy_listen},
        "broker": {"listen": "0.0.0.0:8081"},
        "launcher": {"env_allowlist": ["PATH", "LANG"]},
    })
    return Launcher(cfg, register=False, nflog=False)


@pytest.mark.parametrize("listen", [["0.0.0.0:3128"], ["0.0.0.0:18080", "127.0.0.1:3128"]])
def test_wildcard_proxy_listen_is_usable(listen: list[str]) -> None:
    assert proxy_listen_problem(listen) is None


@pytest.mark.parametrize(("listen", "words"), [
    (["127.0.0.1:3128"], "loopback only"),
    (["127.0.0.53:3128"], "loopback only"),
    (["[::1]:3128"], "loopback only"),
    (["localhost:3128"], "loopback only"),
    (["10.0.0.5:3128"], "not every IPv4 address"),
    (["127.0.0.1:3128", "0.0.0.0:3129"], "loopback only"),  # the first one is the port used
    ([], "empty"),
])
def test_other_proxy_listen_is_refused_with_the_fix(listen: list[str], words: str) -> None:
    problem = proxy_listen_problem(listen)
    assert problem is not None and words in problem
    if listen:
        assert f"0.0.0.0:{listen[0].rsplit(':', 1)[1]}" in problem


def test_env_of_a_proxy_env_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://host-proxy.invalid:1")
    monkeypatch.setenv("LANG", "C.UTF-8")
    la = _launcher(tmp_path, ["0.0.0.0:3130"])
    spec = SandboxSpec("p", ["true"], env={"http_proxy": "http://spec.invalid:2", "A": "b"})
    env = la._env(spec, "10.213.0.1", proxy=True)
    url = "http://10.213.0.1:3130"
    assert {k: env[k] for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} == {
        "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url}
    # the broker (same host-side address) stays direct
    assert env["NO_PROXY"] == env["no_proxy"] == "10.213.0.1"
    assert env["STOCKADE_BROKER"] == "http://10.213.0.1:8081"
    assert "ALL_PROXY" not in env and "all_proxy" not in env
    assert env["A"] == "b" and env["LANG"] == "C.UTF-8"


def test_env_without_the_option_has_no_proxy_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    la = _launcher(tmp_path, ["0.0.0.0:3130"])
    spec = SandboxSpec("p", ["true"], env={k: "http://x.invalid:1" for k in PROXY_ENV_NAMES})
    env = la._env(spec, "10.213.0.1")
    assert [k for k in env if k.upper().endswith("_PROXY")] == []
    assert la.params.proxy_port == 3130


def test_trust_variables_yield_to_the_callers_own(tmp_path: Path) -> None:
    """The inspection CA's variables are defaults: a task's own CA for a private mirror
    (here PIP_CERT) wins, the others stay."""
    la = _launcher(tmp_path, ["0.0.0.0:3130"])
    trust = {"SSL_CERT_FILE": "/etc/b.pem", "PIP_CERT": "/etc/b.pem"}
    spec = SandboxSpec("p", ["true"], env={"PIP_CERT": "/inputs/mirror-ca.pem"})
    env = la._env(spec, "10.213.0.1", trust=trust)
    assert env["PIP_CERT"] == "/inputs/mirror-ca.pem"
    assert env["SSL_CERT_FILE"] == "/etc/b.pem"


@pytest.mark.netns
def test_loopback_proxy_listen_refuses_a_proxy_env_sandbox(lab: Lab) -> None:
    # the lab's gateway settings keep the default proxy_listen 127.0.0.1:3128
    assert lab.config.gateway.proxy_listen[0].startswith("127.")
    small = Limits(memory=64 * 2**20, disk=8 * 2**20, pids=64, ttl=30)
    rs = types.SimpleNamespace(version="lab-proxy", profiles={
        "px": Profile("px", "wants an explicit proxy", limits=small, proxy_env=True)})
    before = lab.launcher.list()
    with pytest.raises(LauncherError, match=r"egress.proxy_env.*loopback only.*0\.0\.0\.0:"):
        lab.launcher.run(SandboxSpec("px", ["true"]), rs)
    assert lab.launcher.list() == before  # refused before anything was created

"""Name tunnelling through the TCP path: SNI, CONNECT authorities under an allowed
wildcard make the gateway resolve names a sandbox chose, so the DNS firewall's
tunnelling guards apply to them too, with one per-task budget shared with DNS.

A real gateway with its DNS firewall, a client namespace whose TCP and port-53 traffic
nftables redirect to it, and the fake internet (every `*.tunnel.test` is NXDOMAIN).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_harness import (
    GatewayHarness,
    fake_internet_config,
    newest_event,
    pip_download,
    running_gateway,
)
from polling import wait_until
from stockade.gateway.dns.settings import DnsSettings

from stockade.ports import free_dual_port
from stockade.testing.testnet import ClientNamespace, FakeInternet
from stockade.testing.testnet.gitrepo import DEMO_BRANCH, DEMO_COMMITS, DEMO_REPO, git_env

pytestmark = pytest.mark.netns

CLIENT = str(Path(__file__).with_name("gw_client.py"))

PROFILE = """\
profile: names
description: name-tunnelling guards on the TCP path
egress:
  allow:
    - host: allowed.test
      ports: [443]
      reason: the test upstream
    - host: "*.tunnel.test"
      ports: [443]
      reason: a wildcard whose subdomains answer NXDOMAIN
    - host: "*.wild.test"
      ports: [80, 443]
      reason: a wildcard whose zone answers every name
    - host: "*.pypi.test"
      ports: [443]
      reason: the fake index under a wildcard, as files.pythonhosted.org is
    - host: "*.git.test"
      ports: [443]
      reason: the fake git server under a wildcard, as a forge's names are
"""

ENTROPY_LABEL = "q7x2m9k4v8z1n6b3w5c0"  # 20 distinct characters: 4.3 bits/char
BUDGET = 4


@pytest.fixture(scope="module")
def gwd(
    fake_internet: FakeInternet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayHarness]:
    cfg = fake_internet_config(
        tmp_path_factory.mktemp("gwnames"),
        fake_internet,
        {"names": PROFILE},
        sniff_timeout_s=1.5,
        dns={
            "listen": [f"0.0.0.0:{free_dual_port()}"],
            "unresolvable_names_per_minute": BUDGET,
            "max_label_length": 40,
            "max_name_length": 120,
        },
    )
    with running_gateway(cfg, dns=True) as h:
        yield h


@pytest.fixture(scope="module")
def ns(gwd: GatewayHarness) -> Iterator[ClientNamespace]:
    assert gwd.svc is not None and gwd.svc.dns is not None
    dns_port = gwd.svc.dns.addresses[0][1]
    n = ClientNamespace(
        name_suffix=f"gwn{secrets.token_hex(3)}",
        redirect_tcp_port=gwd.port("transparent"),
        redirect_dns_port=dns_port,
        exempt_tcp_ports=(gwd.port("proxy"),),
    )
    n.start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def task(gwd: GatewayHarness, ns: ClientNamespace) -> Iterator[str]:
    """A fresh task on the namespace's address: a fresh guard budget per test."""
    tid = f"t-names-{secrets.token_hex(3)}"
    gwd.register(tid, ns.address, "names")
    try:
        yield tid
    finally:
        gwd.control.deregister(tid)


def client(n: ClientNamespace, *args: str, timeout: float = 40) -> dict[str, Any]:
    r = n.run([sys.executable, CLIENT, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def tls(n: ClientNamespace, fi: FakeInternet, sni: str) -> dict[str, Any]:
    """A TLS connection from the sandbox to allowed.test's address with this SNI."""
    return client(n, "tls", fi.addresses["allowed.test"], "443", sni, "-")


def dig(n: ClientNamespace, name: str) -> str:
    """The DNS status the sandbox gets for `name` (port 53 is redirected to the firewall)."""
    r: subprocess.CompletedProcess[str] = n.run(
        ["dig", "+tries=1", "+time=3", f"@{n.host_ip}", name, "A"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    for word in r.stdout.split():
        if word.rstrip(",") in ("NOERROR", "NXDOMAIN", "REFUSED", "SERVFAIL"):
            return word.rstrip(",")
    raise AssertionError(r.stdout)


def event(gw: GatewayHarness, task: str, action: str, name: str) -> dict[str, Any]:
    """The newest event of `task` for `name` (events of allowed flows are batched)."""
    return newest_event(gw, action, 5, labels__task_id=task, destination__domain=name)


def resolved(gw: GatewayHarness, name: str) -> bool:
    assert gw.svc is not None
    return gw.svc.resolver.cached(name) is not None


def test_high_entropy_sni_under_allowed_wildcard_is_denied(
    gwd: GatewayHarness, ns: ClientNamespace, fake_internet: FakeInternet, task: str
) -> None:
    name = f"{ENTROPY_LABEL}.tunnel.test"
    out = tls(ns, fake_internet, name)
    assert "error" in out and "response" not in out  # a TLS alert, never a hang
    ev = event(gwd, task, "connection_decision", name)
    assert ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "high_entropy_label"
    assert ev["stockade"]["component"] == "gateway"
    assert ev["rule"]["id"]  # the wildcard entry the name fell under
    assert not resolved(gwd, name)  # the name never reached the upstream resolver
    # the same name through DNS is refused for the same reason
    assert dig(ns, name) == "REFUSED"
    assert event(gwd, task, "dns_decision", name)["event"]["reason"] == "high_entropy_label"


def test_high_entropy_connect_authority_gets_403(
    gwd: GatewayHarness, ns: ClientNamespace, task: str
) -> None:
    name = f"{ENTROPY_LABEL[::-1]}.tunnel.test"
    out = client(ns, "connect-tls", ns.host_ip, str(gwd.port("proxy")), f"{name}:443", name)
    assert " 403 " in str(out["connect"]) + " "
    assert "high_entropy_label" in str(out["body"])
    ev = event(gwd, task, "connection_decision", name)
    assert ev["event"]["reason"] == "high_entropy_label"
    assert ev["stockade"]["listener"] == "proxy"
    assert not resolved(gwd, name)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("a" * 45 + ".tunnel.test", "label_too_long"),
        (".".join(["abcdefghijklmnopqrstuvwxyz"] * 5) + ".tunnel.test", "name_too_long"),
    ],
)
def test_long_names_in_sni_are_denied(
    gwd: GatewayHarness,
    ns: ClientNamespace,
    fake_internet: FakeInternet,
    task: str,
    name: str,
    reason: str,
) -> None:
    out = tls(ns, fake_internet, name)
    assert "error" in out and "response" not in out
    ev = event(gwd, task, "connection_decision", name)
    assert ev["event"]["reason"] == reason
    assert not resolved(gwd, name)


def test_dns_queries_use_up_the_tcp_budget(
    gwd: GatewayHarness, ns: ClientNamespace, fake_internet: FakeInternet, task: str
) -> None:
    """Distinct NXDOMAIN names asked over DNS exhaust the budget a new SNI draws from."""
    tag = secrets.token_hex(2)
    asked = [f"d{tag}{i}.tunnel.test" for i in range(BUDGET)]
    assert [dig(ns, n) for n in asked] == ["NXDOMAIN"] * BUDGET
    fresh = f"d{tag}x.tunnel.test"
    out = tls(ns, fake_internet, fresh)
    assert "error" in out and "response" not in out
    ev = event(gwd, task, "connection_decision", fresh)
    assert ev["stockade"]["decision"] == "denied"
    assert ev["event"]["reason"] == "unresolvable_name_budget"
    assert not resolved(gwd, fresh)
    # a name already counted is not refused by the budget (it fails to resolve instead)
    tls(ns, fake_internet, asked[0])
    assert event(gwd, task, "connection_decision", asked[0])["event"]["reason"] == (
        "resolve_failed"
    )
    # other allow entries are unaffected
    assert "Hello from allowed.test" in str(tls(ns, fake_internet, "allowed.test")["response"])


def test_tcp_names_use_up_the_dns_budget(
    gwd: GatewayHarness, ns: ClientNamespace, fake_internet: FakeInternet, task: str
) -> None:
    """Distinct unresolvable SNIs exhaust the budget the DNS firewall then enforces."""
    tag = secrets.token_hex(2)
    for i in range(BUDGET):
        name = f"s{tag}{i}.tunnel.test"
        tls(ns, fake_internet, name)
        assert event(gwd, task, "connection_decision", name)["event"]["reason"] == (
            "resolve_failed"
        )
    fresh = f"s{tag}x.tunnel.test"
    assert dig(ns, fresh) == "REFUSED"
    ev = event(gwd, task, "dns_decision", fresh)
    assert ev["event"]["reason"] == "unresolvable_name_budget"
    assert ev["stockade"]["component"] == "dns"


ENCODED_BUDGET = DnsSettings().encoded_names_per_window


def _registered(gw: GatewayHarness, ns: ClientNamespace) -> str:
    tid = f"t-names-{secrets.token_hex(3)}"
    gw.register(tid, ns.address, "names")
    return tid


def _budget_events(gw: GatewayHarness, task: str, want: int) -> list[dict[str, Any]]:
    """The task's name_budget_exceeded decisions, once at least `want` are written."""
    def budget() -> list[dict[str, Any]]:
        evs = [
            e for e in gw.decisions(task) if e["event"]["reason"] == "name_budget_exceeded"
        ]
        return evs if len(evs) >= want else []

    return wait_until(budget, 10, 0.1,
                      what=f"fewer than {want} name_budget_exceeded events for {task}")


@pytest.mark.parametrize("form", ["sni", "host", "connect"])
def test_resolving_wildcard_tunnel_is_budgeted(
    gwd: GatewayHarness,
    ns: ClientNamespace,
    fake_internet: FakeInternet,
    tmp_path: Path,
    form: str,
) -> None:
    """1,000 hex names under `*.wild.test` (whose zone answers every one) as TLS SNI,
    HTTP Host or CONNECT authority: hex stays under the entropy guard and every name
    resolves, so before the name budgets each one was resolved upstream. Now at most the
    budget's worth reach the fake internet's DNS server, one event says why and the end
    summary counts the rest."""
    tag = f"{form}{secrets.token_hex(3)}"
    suffix = f".{tag}.wild.test"
    names = [secrets.token_hex(15) + suffix for _ in range(1000)]
    listing = tmp_path / "names.txt"
    listing.write_text("\n".join(names))
    ip, port = {
        "sni": (fake_internet.addresses["allowed.test"], 443),
        "host": (fake_internet.addresses["allowed.test"], 80),
        "connect": (ns.host_ip, gwd.port("proxy")),
    }[form]
    task = _registered(gwd, ns)
    try:
        # (a thousand connections: a generous bound for a loaded, shared machine)
        out = client(ns, "names", form, ip, str(port), str(listing), timeout=600)["outcomes"]
        through = out.pop("through", 0)
        # refused names get the gateway's answer: a TLS alert, or a 403 saying why
        refusal = "tls_alert" if form == "sni" else "name_budget_exceeded"
        assert out == {refusal: 1000 - through}, out
        assert 0 < through <= ENCODED_BUDGET
        # counted at the upstream resolver: each name that went through was resolved
        # there once (a CONNECT's too: its client sends a request through the tunnel),
        # and no refused name was
        asked = {n for n, _ in fake_internet.dns_queries() if n.endswith(suffix)}
        assert len(asked) == through
        first = _budget_events(gwd, task, 1)
    finally:
        gwd.control.deregister(task)
    assert len(first) == 1  # one event for the first refusal, not one per name
    assert first[0]["stockade"]["name_budget"] == "encoded_names"
    assert first[0]["rule"]["id"]
    assert first[0]["destination"]["domain"].endswith(suffix)
    # the task's end summary counts every refusal that had no event of its own
    evs = _budget_events(gwd, task, 2)
    assert len(evs) == 2
    assert evs[1]["stockade"]["suppressed_events"] == 1000 - through - 1
    assert "more names refused" in evs[1]["message"]


def _git(
    ns: ClientNamespace, fi: FakeInternet, proxy: str, home: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """Real git in the sandbox, through the explicit proxy, trusting the fake CA only."""
    return ns.run(
        ["git", "-c", f"http.proxy={proxy}", "-c", f"http.sslCAInfo={fi.ca_pem}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=home,
        env=git_env(home) | {"GIT_TERMINAL_PROMPT": "0"},
    )


def test_pip_and_git_under_wildcards_stay_within_budget(
    gwd: GatewayHarness, ns: ClientNamespace, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    """Real wildcard use: pip downloads from the index under `*.pypi.test`, and git
    clones, lists and fetches the demo repository under `*.git.test` (several names, each
    asked more than once, as a clone from a forge does) through the gateway, well within
    the default budgets."""
    fi = fake_internet
    task = _registered(gwd, ns)
    proxy = f"http://{ns.host_ip}:{gwd.port('proxy')}"
    names = ["github.git.test", "codeload.git.test", "api.git.test"]
    served = subprocess.run(
        ["git", "--git-dir", str(fi.git_root / DEMO_REPO), "rev-parse", DEMO_BRANCH],
        capture_output=True, text=True, check=True, env=git_env(tmp_path),
    ).stdout.strip()  # fmt: skip
    try:
        dl = tmp_path / "dl"
        r = pip_download(
            ns, dl, proxy, "--cert", fi.ca_pem, "--index-url", "https://files.pypi.test/simple/"
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert any(p.suffix == ".whl" for p in dl.iterdir())
        for i in range(2):
            work = tmp_path / f"clone{i}"
            url = f"https://{names[0]}/{DEMO_REPO}"
            r = _git(ns, fi, proxy, tmp_path, "clone", "--depth", "1", url, str(work))
            assert r.returncode == 0, r.stderr
            assert (work / "hello.py").read_text() == DEMO_COMMITS[-1].files["hello.py"]
            r = _git(ns, fi, proxy, tmp_path, "ls-remote", f"https://{names[2]}/{DEMO_REPO}")
            assert r.returncode == 0, r.stderr
            assert f"{served}\trefs/heads/{DEMO_BRANCH}" in r.stdout.splitlines()
            # the rest of the history, from another name under the same wildcard
            fetch_url = f"https://{names[1]}/{DEMO_REPO}"
            r = _git(ns, fi, proxy, work, "fetch", "--unshallow", "--tags", fetch_url)
            assert r.returncode == 0, r.stderr
            r = _git(ns, fi, proxy, work, "rev-list", "--count", "HEAD")
            assert r.stdout.strip() == str(len(DEMO_COMMITS)), r.stderr
    finally:
        gwd.control.deregister(task)
    def domains_of(evs: list[dict[str, Any]]) -> set[Any]:
        return {e.get("destination", {}).get("domain") for e in evs}

    def written() -> list[dict[str, Any]]:  # allowed flows' events are written in batches
        evs = gwd.decisions(task)
        return evs if {"files.pypi.test", *names} <= domains_of(evs) else []

    decisions = wait_until(written, what=f"decisions of {task} for every name")
    reasons = {e["event"]["reason"] for e in decisions}
    assert "name_budget_exceeded" not in reasons
    assert reasons <= {"allowed_by_rule"}, reasons
    domains = domains_of(decisions)
    assert {"files.pypi.test", *names} <= domains  # git went through the gateway

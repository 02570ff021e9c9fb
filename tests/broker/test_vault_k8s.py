"""Vault's Kubernetes auth in the broker, against the real OpenBao dev server.

OpenBao's kubernetes auth method is enabled and pointed at a minimal TokenReview endpoint
served here over TLS on 127.0.0.1 (no Kubernetes API server can run on these machines): it
answers for the service-account tokens the test declares valid, as the API server would.
Time is a fake clock in the client (token age), so nothing sleeps.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pydantic
import pytest
import trustme
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from stockade.broker.settings import KubernetesAuthSettings, VaultSettings
from stockade.broker.vault import VaultClient, VaultUnavailable
from stockade.policy.model import CredentialSource

from stockade.testing.devvault import DevOpenBao

pytestmark = pytest.mark.vault

NAMESPACE, ACCOUNT = "stockade-system", "stockade"
REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def account_uid(account: str) -> str:
    """The service account's uid: in its tokens and in TokenReview's answer (Vault compares)."""
    return str(uuid.uuid5(uuid.NAMESPACE_OID, account))


def service_account_jwt(account: str = ACCOUNT) -> str:
    """A token shaped like the kubelet's projected service-account token (RS256)."""
    header = {"alg": "RS256", "kid": "test", "typ": "JWT"}
    now = int(time.time())
    claims = {
        "iss": "https://kubernetes.default.svc",
        "sub": f"system:serviceaccount:{NAMESPACE}:{account}",
        "aud": ["vault"], "iat": now, "nbf": now, "exp": now + 3600, "jti": uuid.uuid4().hex,
        "kubernetes.io": {"namespace": NAMESPACE,
                          "serviceaccount": {"name": account, "uid": account_uid(account)}},
    }
    signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    sig = _KEY.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing}.{_b64(sig)}"


@dataclass
class TokenReviewer:
    """The API server's TokenReview, for the tokens in `valid` (token -> account)."""

    url: str = ""
    ca_pem: str = ""
    valid: dict[str, str] = field(default_factory=dict)
    reviewed: list[str] = field(default_factory=list)


def _handler(reviewer: TokenReviewer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            # client-go's typed client sends the spec without apiVersion and kind
            if self.path.split("?")[0] != REVIEW_PATH or "token" not in body.get("spec", {}):
                self.send_error(404)
                return
            token = body["spec"]["token"]
            reviewer.reviewed.append(token)
            account = reviewer.valid.get(token)
            status: dict[str, Any] = {"authenticated": False, "error": "token is not valid"}
            if account is not None:
                status = {
                    "authenticated": True,
                    "user": {"username": f"system:serviceaccount:{NAMESPACE}:{account}",
                             "uid": account_uid(account),
                             "groups": ["system:serviceaccounts",
                                        f"system:serviceaccounts:{NAMESPACE}"]},
                    "audiences": body["spec"].get("audiences") or ["vault"],
                }
            out = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                              "status": status}).encode()
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *_args: Any) -> None:
            return None

    return Handler


@pytest.fixture(scope="module")
def reviewer() -> Iterator[TokenReviewer]:
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    rev = TokenReviewer(ca_pem=ca.cert_pem.bytes().decode())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(rev))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    rev.url = f"https://127.0.0.1:{server.server_address[1]}"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield rev
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def bao(reviewer: TokenReviewer) -> Iterator[DevOpenBao]:
    with DevOpenBao() as b:
        c = b.client()
        c.sys.enable_auth_method("kubernetes")
        c.auth.kubernetes.configure(kubernetes_host=reviewer.url,
                                    kubernetes_ca_cert=reviewer.ca_pem,
                                    disable_local_ca_jwt=True)
        yield b


def make_role(bao: DevOpenBao, *, ttl: str = "60s") -> str:
    role = "broker-" + uuid.uuid4().hex[:6]
    c = bao.client()
    c.sys.create_or_update_policy(
        name=role, policy='path "secret/data/*" { capabilities = ["read"] }')
    c.auth.kubernetes.create_role(
        name=role, bound_service_account_names=[ACCOUNT],
        bound_service_account_namespaces=[NAMESPACE], policies=[role], ttl=ttl, max_ttl="1h",
        audience="vault")
    return role


def k8s_settings(bao: DevOpenBao, role: str, token_file: Path) -> VaultSettings:
    return VaultSettings(address=bao.address, auth="kubernetes",
                         kubernetes=KubernetesAuthSettings(role=role, token_file=str(token_file)))


def cred(path: str) -> CredentialSource:
    return CredentialSource("secret", path, "token")


async def test_login_renew_and_relogin_with_the_rotated_token(
    bao: DevOpenBao, reviewer: TokenReviewer, tmp_path: Path
) -> None:
    path = "stockade/k8s-" + uuid.uuid4().hex[:8]
    bao.put_secret(path, "token", "k8s-value-1")
    role = make_role(bao)
    first = service_account_jwt()
    reviewer.valid[first] = ACCOUNT
    token_file = tmp_path / "token"
    token_file.write_text(first + "\n")
    clock = FakeClock()
    v = VaultClient(k8s_settings(bao, role, token_file), cache_ttl_s=10, clock=clock)
    try:
        await v.start()
        assert v.logins == 1 and reviewer.reviewed[-1] == first
        assert (await v.get(cred(path))).value == "k8s-value-1"
        lookup = bao.client().auth.token.lookup(v._client.token)["data"]
        assert lookup["meta"]["service_account_name"] == ACCOUNT
        assert lookup["meta"]["role"] == role
        # renewal when 2/3 of the 60 s lease are gone, no new login
        await v.renew_now()
        assert v.renewals == 0
        clock.t += 45
        await v.renew_now()
        assert v.renewals == 1 and v.logins == 1
        # the kubelet rotates the token and the old one stops being valid; Vault's token
        # expires (revoked here): the next read logs in again, with the file's new token
        second = service_account_jwt()
        reviewer.valid[second] = ACCOUNT
        del reviewer.valid[first]
        token_file.write_text(second)
        bao.client().auth.token.revoke(v._client.token)
        clock.t += 11  # past the cache TTL
        assert (await v.get(cred(path))).value == "k8s-value-1"
        assert v.logins == 2 and reviewer.reviewed[-1] == second
    finally:
        await v.close()


async def test_renewal_refused_logs_in_again(
    bao: DevOpenBao, reviewer: TokenReviewer, tmp_path: Path
) -> None:
    role = make_role(bao)
    jwt = service_account_jwt()
    reviewer.valid[jwt] = ACCOUNT
    (tmp_path / "token").write_text(jwt)
    clock = FakeClock()
    v = VaultClient(k8s_settings(bao, role, tmp_path / "token"), clock=clock)
    try:
        await v.start()
        old = v._client.token
        bao.client().auth.token.revoke(old)  # expired: renew_self is refused
        clock.t += 50
        await v.renew_now()
        assert v.logins == 2 and v.renewals == 0 and v._client.token != old
        assert bao.client().auth.token.lookup(v._client.token)["data"]["ttl"] > 0
    finally:
        await v.close()


async def test_bad_tokens_fail_closed_and_say_why(
    bao: DevOpenBao, reviewer: TokenReviewer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = "stockade/k8s-bad-" + uuid.uuid4().hex[:8]
    bao.put_secret(path, "token", "never-served")
    role = make_role(bao)
    # no token file: the log names the file and the likely cause
    v = VaultClient(k8s_settings(bao, role, tmp_path / "absent"))
    try:
        assert await v.ensure_login() is False
        assert "absent does not exist" in caplog.text
        assert "service-account token mounted" in caplog.text
        with pytest.raises(VaultUnavailable) as ei:
            await v.get(cred(path))
        assert ei.value.cause == "KubernetesLoginError"
    finally:
        await v.close()
    # empty file
    (tmp_path / "empty").write_text("\n")
    v = VaultClient(k8s_settings(bao, role, tmp_path / "empty"))
    try:
        assert await v.ensure_login() is False
        assert "empty is empty" in caplog.text
    finally:
        await v.close()
    # a token the API server does not vouch for, and one of a service account the role
    # is not bound to (refused by Vault from its claims)
    unknown, stranger = service_account_jwt(), service_account_jwt("intruder")
    reviewer.valid[stranger] = "intruder"
    for jwt in (unknown, stranger):
        (tmp_path / "token").write_text(jwt)
        v = VaultClient(k8s_settings(bao, role, tmp_path / "token"))
        try:
            assert await v.ensure_login() is False
            with pytest.raises(VaultUnavailable) as ei:
                await v.get(cred(path))
            assert str(ei.value) == "credential store unavailable"
        finally:
            await v.close()
    assert unknown in reviewer.reviewed  # refused by the API server, not only by its claims
    assert unknown not in caplog.text and stranger not in caplog.text
    assert "never-served" not in caplog.text


def test_auth_setting_needs_its_section() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"auth: kubernetes needs vault\.kubernetes"):
        VaultSettings(address="http://127.0.0.1:1", auth="kubernetes")
    with pytest.raises(pydantic.ValidationError, match=r"auth: token needs vault\.token_file"):
        VaultSettings(address="http://127.0.0.1:1", auth="token")
    with pytest.raises(pydantic.ValidationError, match="also set auth: kubernetes"):
        VaultSettings(address="http://127.0.0.1:1", kubernetes=KubernetesAuthSettings(role="r"))
    with pytest.raises(pydantic.ValidationError, match="role"):
        KubernetesAuthSettings(role="")
    s = VaultSettings(auth="kubernetes", kubernetes=KubernetesAuthSettings(role="r"))
    assert s.auth_mode == "kubernetes"
    assert s.kubernetes is not None
    assert s.kubernetes.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    # today's settings keep their meaning without `auth`
    assert VaultSettings(token_file="/t").auth_mode == "token"
    assert VaultSettings().auth_mode is None

"""Vault's Kubernetes auth method: the pod's service-account token for a Vault token.

On a fleet the broker runs in a pod; its service-account token (projected by the kubelet)
is its identity. Vault asks the cluster's TokenReview API whether the token is valid and
which service account it names, and answers with a Vault token of the role bound to it.
The token file is read again at every login: the kubelet rotates projected tokens, so a
token read at start would be refused once it expires. hvac's Kubernetes method does the
protocol; renewal and re-login on expiry are `broker/vault.py`'s, as for AppRole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hvac

from .settings import KubernetesAuthSettings


class KubernetesLoginError(Exception):
    """The service-account token cannot be read. Its text names the file and what is
    wrong with it, never the token (safe to log, unlike hvac's exceptions)."""


def read_service_account_token(path: str) -> str:
    """The token in `path`, stripped; a clear error when it is missing, unreadable or empty."""
    try:
        token = Path(path).read_text().strip()
    except FileNotFoundError:
        raise KubernetesLoginError(
            f"vault.kubernetes.token_file {path} does not exist (is the pod's "
            "service-account token mounted? automountServiceAccountToken or a projected "
            "volume)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KubernetesLoginError(
            f"vault.kubernetes.token_file {path} cannot be read: {type(e).__name__}") from None
    if not token:
        raise KubernetesLoginError(f"vault.kubernetes.token_file {path} is empty")
    return token


def kubernetes_login(client: hvac.Client, settings: KubernetesAuthSettings) -> dict[str, Any]:
    """Log in with the current service-account token; returns Vault's `auth` block
    (client_token, lease_duration, renewable). The client's own token is left to the caller."""
    jwt = read_service_account_token(settings.token_file)
    resp = client.auth.kubernetes.login(
        role=settings.role, jwt=jwt, use_token=False, mount_point=settings.mount)
    auth: dict[str, Any] = resp["auth"]
    return auth

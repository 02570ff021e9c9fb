"""A call's credential: the secret from the secret source (Vault), rendered for one API's
injection with the patterns that scrub its echoes, and cached so a repeated call does not
re-render headers or recompile patterns."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stockade.policy.model import ApiDefinition
from stockade.policy.reasons import Reason

from .denials import Denied
from .inject import inject
from .request import RequestError, encode_query
from .scrub import Patterns
from .secretvalue import SecretValue, VaultUnavailable

MAX_CACHED = 256


class SecretSource(Protocol):
    async def get(self, cred: Any) -> SecretValue: ...

    # optional: `fresh(cred) -> SecretValue | None`, a cache hit without a coroutine


@dataclass(frozen=True, slots=True)
class Credential:
    """One secret rendered for one API's injection, with its scrub patterns."""

    headers: tuple[tuple[str, str], ...]  # injected headers + forced Accept-Encoding
    query: tuple[str, ...]  # encoded injected query parts
    patterns: Patterns


class CredentialCache:
    """`secrets` may be replaced while serving; the cache-hit shortcut (`fresh`) is the
    one of the source given at construction."""

    def __init__(self, secrets: SecretSource) -> None:
        self.secrets = secrets
        self._fresh: Callable[[Any], SecretValue | None] | None = getattr(
            secrets, "fresh", None)
        self._cached: OrderedDict[tuple[Any, ...], Credential] = OrderedDict()

    async def fetch(self, api: ApiDefinition) -> Credential:
        """The API's credential; Vault down -> 503 `vault_unavailable`."""
        try:
            sv = self._fresh(api.credential) if self._fresh is not None else None
            if sv is None:
                sv = await self.secrets.get(api.credential)
        except VaultUnavailable:
            raise Denied(503, Reason.VAULT_UNAVAILABLE, "credential store unavailable") from None
        return self.render(api, sv)

    def render(self, api: ApiDefinition, sv: SecretValue) -> Credential:
        # keyed by the injection too: a reload may change the template or user name,
        # and with it the rendered values that must be scrubbed
        key = (api.name, api.injection, sv.value, sv.version)
        c = self._cached.get(key)
        if c is None:
            try:
                inj = inject(api.injection, sv.value)
                query = encode_query(inj.query)
            except RequestError:
                raise Denied(503, Reason.VAULT_UNAVAILABLE, "credential unusable") from None
            c = Credential((*inj.headers, ("Accept-Encoding", "identity")), query,
                           Patterns.build((sv.value, *inj.rendered_values)))
            self._cached[key] = c
            while len(self._cached) > MAX_CACHED:
                self._cached.popitem(last=False)
        else:
            self._cached.move_to_end(key)
        return c

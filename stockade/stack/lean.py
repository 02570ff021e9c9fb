"""What an embedded stack can leave out for the rules it serves (pure).

`stockade run` on embedded defaults starts gateway, broker and a dev OpenBao for one
command. The gateway's L7 inspector (a mitmproxy child: the largest part of the
gateway's start) serves only TLS flows of entries with an `http:` block or
`host_must_match_sni`; when no entry of the rules the gateway loads has one, the stack
starts without it. A flow that would need it is denied `inspection_unavailable` (fail
closed), as with `gateway.inspection.enabled: false`. Likewise the dev OpenBao (about a
second to start and to stop): without `vault.address`, secrets to put and any broker grant
in the rules, the stack runs without it (`dev_vault.enabled: false`; the broker then serves
no credential). Concurrent runs on the same configuration and rules compute the same, so
they still share one stack.
"""

from __future__ import annotations

from typing import Any


def inspection_needed(ruleset: Any) -> bool:
    """Some allow entry of a profile or preset is inspected."""
    entries = [e for p in ruleset.profiles.values() for e in p.allow]
    entries += [e for p in ruleset.presets.values() for e in p.allow]
    return any(e.inspected for e in entries)


def without_unneeded_inspector(config: Any, ruleset: Any) -> Any:
    """`config` with the inspector off when the configuration leaves it to the defaults
    and `ruleset` (the rules of `config.rules_dir`) has no inspected entry."""
    insp = config.gateway.inspection
    if "enabled" in insp.model_fields_set or not insp.enabled or inspection_needed(ruleset):
        return config
    gateway = config.gateway.model_copy(
        update={"inspection": insp.model_copy(update={"enabled": False})})
    return config.model_copy(update={"gateway": gateway})


def vault_needed(ruleset: Any) -> bool:
    """Some profile grants a broker API (its credential is read from Vault)."""
    return any(p.broker for p in ruleset.profiles.values())


def without_unneeded_vault(config: Any, ruleset: Any, secrets: bool) -> Any:
    """`config` with the dev OpenBao left out when it would start one (no vault.address,
    `dev_vault.enabled` left to the default) that nothing reads: no `secrets` given on the
    command line, none in `dev_vault.secrets`, no broker grant in `ruleset`."""
    dv = config.dev_vault
    if (config.vault.address is not None or "enabled" in dv.model_fields_set or not dv.enabled
            or secrets or dv.secrets or vault_needed(ruleset)):
        return config
    return config.model_copy(update={"dev_vault": dv.model_copy(update={"enabled": False})})

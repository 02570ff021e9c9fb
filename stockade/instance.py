"""Settings of one self-contained instance that follow `run_dir`, `base_port` and
`upstream_ca_file` (pure); the event chain's directory follows `state_dir`.

Without this a second instance on one host had to restate a dozen sockets and ports. Each
derived key is filled in only where the file leaves it unset, so every one stays
overridable; without `base_port` the ports keep their documented defaults.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

# (section path, key) -> socket file name under run_dir
SOCKETS: dict[tuple[tuple[str, ...], str], str] = {
    (("gateway",), "control_socket"): "gateway.sock",
    (("broker",), "control_socket"): "broker.sock",
    (("launcher",), "control_socket"): "launcher.sock",
}
# (section path, key) -> (offset from base_port, bind host, a list of addresses?)
PORTS: dict[tuple[tuple[str, ...], str], tuple[int, str, bool]] = {
    (("gateway",), "transparent_listen"): (0, "0.0.0.0", True),  # noqa: S104 - sandboxes' side
    (("gateway",), "proxy_listen"): (1, "127.0.0.1", True),
    (("dns",), "listen"): (2, "0.0.0.0", True),  # noqa: S104 - sandboxes' side
    (("broker",), "listen"): (3, "0.0.0.0", False),  # noqa: S104 - sandboxes' side
    (("gateway",), "metrics_listen"): (4, "127.0.0.1", False),
    (("broker",), "metrics_listen"): (5, "127.0.0.1", False),
}
DEV_VAULT_PORT_OFFSET = 6  # the embedded dev OpenBao (dev_vault.port)
PORT_SPAN = DEV_VAULT_PORT_OFFSET + 1  # base_port .. base_port + PORT_SPAN - 1
# the components' own settings for the CA bundle that verifies upstream TLS
UPSTREAM_CA_KEYS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("gateway", "inspection"), "upstream_ca_file"),
    (("broker",), "ca_file"),
)
DEFAULT_RUN_DIR = "/run/stockade"
DEFAULT_STATE_DIR = "/var/lib/stockade"  # Config.state_dir's default


def _is_model(section: Any) -> bool:
    # a pydantic model, told by its API rather than isinstance: this module is read by
    # stockade.configpeek too, whose commands never import pydantic
    return hasattr(section, "model_fields_set") and hasattr(section, "model_copy")


def _is_set(section: Any, key: str, null_unset: bool) -> bool:
    if _is_model(section):
        return key in section.model_fields_set and not (
            null_unset and getattr(section, key) is None)
    return isinstance(section, dict) and key in section and not (
        null_unset and section[key] is None)


def _fill(data: dict[str, Any], path: tuple[str, ...], key: str, value: Any,
          null_unset: bool = False) -> None:
    """data[path...][key] = value unless the user set it (with `null_unset`, a null counts
    as unset); sections may be dicts or models."""
    head, rest = path[0], path[1:]
    section = data.get(head, {})
    if rest:
        if _is_model(section):
            return  # a section given as a model is taken as it is
        section = dict(section) if isinstance(section, dict) else section
        if not isinstance(section, dict):
            return  # not a mapping: let validation report it
        _fill(section, rest, key, value, null_unset)
        data[head] = section
        return
    if _is_set(section, key, null_unset):
        return
    if _is_model(section):
        data[head] = section.model_copy(update={key: value})
    elif isinstance(section, dict):
        data[head] = {**section, key: value}


def derive(data: Any) -> Any:
    """The raw `stockade.yaml` mapping with the derived defaults filled in."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    run_dir = out.get("run_dir", DEFAULT_RUN_DIR)
    if isinstance(run_dir, str):
        for (path, key), name in SOCKETS.items():
            _fill(out, path, key, str(PurePosixPath(run_dir) / name))
    base = out.get("base_port")
    if isinstance(base, int) and not isinstance(base, bool) and 0 < base <= 65536 - PORT_SPAN:
        for (path, key), (offset, host, many) in PORTS.items():
            addr = f"{host}:{base + offset}"
            _fill(out, path, key, [addr] if many else addr)
        _fill(out, ("dev_vault",), "port", base + DEV_VAULT_PORT_OFFSET)
    state_dir = out.get("state_dir", DEFAULT_STATE_DIR)
    if isinstance(state_dir, str):
        # null too: a chain without a key (unsigned) is never what a config file means
        _fill(out, ("events",), "chain_dir", str(PurePosixPath(state_dir) / "events-chain"),
              null_unset=True)
    ca = out.get("upstream_ca_file")
    if isinstance(ca, str) and ca:
        for path, key in UPSTREAM_CA_KEYS:
            _fill(out, path, key, ca)
    return out

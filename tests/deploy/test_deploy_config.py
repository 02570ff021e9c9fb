"""deploy/stockade.yaml: loads with the real config loader, names every key of every section,
and agrees with the systemd units about paths, ports and limits."""

from __future__ import annotations

import ipaddress
import warnings
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml
from deploy_support import EXAMPLE_CONFIG, UNITS, parse_unit, unit_value, unit_values
from pydantic import BaseModel

from stockade.config import Config, load_config


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(EXAMPLE_CONFIG)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE_CONFIG.read_text())


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):  # Optional[Model]
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _missing_keys(model: type[BaseModel], data: dict[str, Any], prefix: str) -> list[str]:
    missing = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if name not in data:
            missing.append(key)
            continue
        sub = _model_of(field.annotation)
        if sub is not None and isinstance(data[name], dict):
            missing += _missing_keys(sub, data[name], key + ".")
    return missing


def test_example_config_loads(config: Config) -> None:
    assert config.events_file == PurePosixPath("/var/log/stockade/events.jsonl")
    assert config.vault.address and config.vault.approle is not None


def test_example_config_has_every_section(raw: dict[str, Any]) -> None:
    assert set(raw) == set(Config.model_fields)
    for name, field in Config.model_fields.items():
        if _model_of(field.annotation) is not None:
            assert isinstance(raw[name], dict) and raw[name], f"section {name} is empty"


def test_example_config_sets_every_key(raw: dict[str, Any]) -> None:
    """Operators copy this file: every key the models define is spelled out. A key added to
    a settings model since is reported as a warning, not a failure, so that adding a key
    (with its default) never breaks the build; add it to deploy/stockade.yaml."""
    missing = _missing_keys(Config, raw, "")
    if missing:
        warnings.warn(
            f"deploy/stockade.yaml does not spell out: {', '.join(missing)}", stacklevel=1
        )


def test_example_config_is_production_shaped(config: Config) -> None:
    assert PurePosixPath(config.rules_dir).is_absolute(), "services start with cwd /"
    for listen in (config.gateway.metrics_listen, config.broker.metrics_listen):
        host = listen.rpartition(":")[0].strip("[]")
        assert ipaddress.ip_address(host).is_loopback, f"metrics on {listen}: sandboxes reach it"
    assert config.vault.approle is not None
    assert not config.vault.approle.secret_id_wrapped, "a wrapped secret id survives no restart"


def _ports(config: Config) -> list[int]:
    addrs = [
        *config.gateway.transparent_listen,
        *config.gateway.proxy_listen,
        config.gateway.metrics_listen,
        *config.dns.listen,
        config.broker.listen,
        config.broker.metrics_listen,
    ]
    return [int(a.rpartition(":")[2]) for a in addrs]


def test_units_grant_no_bind_capability_so_ports_are_unprivileged(config: Config) -> None:
    for name, path in UNITS.items():
        unit = parse_unit(path)
        caps = unit_value(unit, "Service", "CapabilityBoundingSet") or ""
        if "CAP_NET_BIND_SERVICE" not in caps:
            low = [p for p in _ports(config) if p < 1024]
            assert not low, f"{name}: ports {low} < 1024 need CAP_NET_BIND_SERVICE"


def _under(path: str, dirs: list[str]) -> bool:
    p = PurePosixPath(path)
    return any(p == PurePosixPath(d) or PurePosixPath(d) in p.parents for d in dirs)


def _writable(unit: dict[str, list[tuple[str, str]]]) -> list[str]:
    out = []
    for key, base in (
        ("StateDirectory", "/var/lib"),
        ("LogsDirectory", "/var/log"),
        ("RuntimeDirectory", "/run"),
    ):
        for v in unit_values(unit, "Service", key):
            out += [f"{base}/{d}" for d in v.split()]
    for v in unit_values(unit, "Service", "ReadWritePaths"):
        out += [d.lstrip("-") for d in v.split()]
    return out


def test_every_path_a_service_writes_is_writable_in_its_unit(config: Config) -> None:
    gw = _writable(parse_unit(UNITS["gateway"]))
    br = _writable(parse_unit(UNITS["broker"]))
    assert config.gateway.registry_file is not None and config.broker.state_file is not None
    chain_head = f"{config.events.chain_dir}/heads/x.json"  # the event chain's heads
    for path in (
        config.gateway.registry_file,
        config.gateway.control_socket,
        str(config.events_file),
        chain_head,
    ):
        assert _under(str(PurePosixPath(path).parent), gw), f"gateway cannot write {path}"
    for path in (config.broker.state_file, config.broker.control_socket, str(config.events_file),
                 chain_head):
        assert _under(str(PurePosixPath(path).parent), br), f"broker cannot write {path}"


def test_state_directories_leave_the_launcher_tree_alone(config: Config) -> None:
    """StateDirectory=stockade would chown /var/lib/stockade (and the launcher's sandboxes
    under it) to the service user: each unit owns only its own subdirectory."""
    for name, path in UNITS.items():
        for v in unit_values(parse_unit(path), "Service", "StateDirectory"):
            for d in v.split():
                assert d.startswith("stockade/"), f"{name}: StateDirectory={d}"
    assert not _under(config.launcher.scratch_dir, ["/var/lib/stockade/gateway"])
    assert not _under(config.launcher.scratch_dir, ["/var/lib/stockade/broker"])


def test_nofile_limit_matches_max_open_files(config: Config) -> None:
    limit = unit_value(parse_unit(UNITS["gateway"]), "Service", "LimitNOFILE")
    assert limit is not None and int(limit) >= config.gateway.max_open_files


def test_vault_credentials_come_from_the_broker_units_credentials(config: Config) -> None:
    unit = parse_unit(UNITS["broker"])
    creds = {v.split(":", 1)[0] for v in unit_values(unit, "Service", "LoadCredential")}
    approle = config.vault.approle
    assert approle is not None
    for path in (approle.role_id_file, approle.secret_id_file):
        p = PurePosixPath(path)
        assert p.parent == PurePosixPath("/run/credentials/stockade-broker.service"), path
        assert p.name in creds, f"{p.name} is not loaded by LoadCredential="

"""A self-contained instance follows `run_dir` and one `base_port`; one `upstream_ca_file`
serves the gateway's inspection and the broker; every derived key stays overridable."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stockade.config import Config, ConfigError, load_config
from stockade.instance import PORT_SPAN, derive


def _load(tmp_path, text: str) -> Config:
    p = tmp_path / "stockade.yaml"
    p.write_text(text)
    return load_config(p)


def test_sockets_follow_run_dir(tmp_path):
    cfg = _load(tmp_path, "run_dir: /tmp/inst-a\n")
    assert cfg.gateway.control_socket == "/tmp/inst-a/gateway.sock"
    assert cfg.broker.control_socket == "/tmp/inst-a/broker.sock"
    assert cfg.launcher.control_socket == "/tmp/inst-a/launcher.sock"


def test_ports_follow_one_base_port(tmp_path):
    cfg = _load(tmp_path, "base_port: 18000\n")
    assert cfg.gateway.transparent_listen == ["0.0.0.0:18000"]
    assert cfg.gateway.proxy_listen == ["127.0.0.1:18001"]
    assert cfg.dns.listen == ["0.0.0.0:18002"]
    assert cfg.broker.listen == "0.0.0.0:18003"
    assert cfg.gateway.metrics_listen == "127.0.0.1:18004"
    assert cfg.broker.metrics_listen == "127.0.0.1:18005"
    assert cfg.dev_vault.port == 18006


def test_each_derived_key_stays_overridable(tmp_path):
    cfg = _load(
        tmp_path,
        "run_dir: /tmp/inst-b\nbase_port: 18000\n"
        "gateway: {control_socket: /tmp/own.sock, proxy_listen: ['127.0.0.1:3000']}\n"
        "broker: {metrics_listen: ''}\ndev_vault: {port: 8200}\n",
    )
    assert cfg.gateway.control_socket == "/tmp/own.sock"
    assert cfg.gateway.proxy_listen == ["127.0.0.1:3000"]
    assert cfg.gateway.transparent_listen == ["0.0.0.0:18000"]
    assert cfg.broker.metrics_listen == ""
    assert cfg.broker.control_socket == "/tmp/inst-b/broker.sock"
    assert cfg.dev_vault.port == 8200


def test_defaults_are_unchanged_without_base_port():
    cfg = Config()
    assert cfg.gateway.transparent_listen == ["0.0.0.0:15001"]
    assert cfg.gateway.control_socket == "/run/stockade/gateway.sock"
    assert cfg.broker.listen == "0.0.0.0:8081"
    assert cfg.dev_vault.port is None


def test_one_upstream_ca_serves_inspection_and_broker(tmp_path):
    cfg = _load(tmp_path, "upstream_ca_file: /etc/private-ca.pem\n")
    assert cfg.gateway.inspection.upstream_ca_file == "/etc/private-ca.pem"
    assert cfg.broker.ca_file == "/etc/private-ca.pem"
    own = _load(
        tmp_path,
        "upstream_ca_file: /etc/private-ca.pem\nbroker: {ca_file: /etc/broker-ca.pem}\n",
    )
    assert own.broker.ca_file == "/etc/broker-ca.pem"
    assert own.gateway.inspection.upstream_ca_file == "/etc/private-ca.pem"


def test_the_effective_config_round_trips(tmp_path):
    """The stack hands its children a dump of the effective config: loading it gives it back."""
    cfg = _load(tmp_path, "run_dir: /tmp/inst-c\nbase_port: 20000\nupstream_ca_file: /ca.pem\n")
    assert Config.model_validate(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("base_port: 0\n", "base_port"),
        (f"base_port: {65536 - PORT_SPAN + 1}\n", "base_port"),
        ("base_port: lots\n", "base_port"),
        ("gateway: 3\n", "gateway"),
    ],
)
def test_bad_instance_settings_are_clear_errors(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        _load(tmp_path, text)


@given(st.dictionaries(st.sampled_from(["run_dir", "base_port", "upstream_ca_file", "gateway",
                                        "broker", "dns", "dev_vault"]),
                       st.one_of(st.none(), st.integers(), st.text(max_size=5),
                                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))))
def test_derive_never_raises_and_never_drops_a_given_key(data):
    out = derive(data)
    for key, value in data.items():
        if not isinstance(value, dict):
            assert out[key] == value
        else:
            assert {k: out[key][k] for k in value} == value

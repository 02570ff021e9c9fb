"""Listen addresses are checked when stockade.yaml is loaded, by the same parser the
servers bind with: a malformed one is a config error (exit 2, one line), never a
ValueError traceback at start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stockade.config import ConfigError, load_config
from stockade.listen import parse_listen


@pytest.mark.parametrize(
    ("addr", "want"),
    [
        ("127.0.0.1:3128", ("127.0.0.1", 3128)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::]:0", ("::", 0)),
        ("[::1]:53", ("::1", 53)),
    ],
)
def test_parse_listen(addr: str, want: tuple[str, int]) -> None:
    assert parse_listen(addr) == want


@pytest.mark.parametrize(
    ("addr", "why"),
    [
        ("host", "no port"),
        ("host:", "not a number"),
        ("host:http", "not a number"),
        ("host:-1", "not a number"),
        ("host:65536", "out of range"),
        ("host:\u00b2", "not a number"),  # a digit to str.isdigit(), not to int()
        (":8080", "no host"),
        ("::1:80", "needs brackets"),
        ("[::1]", "no port"),
        ("[::1:80", "missing ']'"),
        ("[host]:80", "not an IPv6 address"),
        ("a b:80", "invalid character"),
        (" 127.0.0.1:80", "not an address"),
        ("", "not an address"),
    ],
)
def test_parse_listen_refuses(addr: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        parse_listen(addr)


def test_default_port_for_dns_servers() -> None:
    assert parse_listen("10.0.0.1", default_port=53) == ("10.0.0.1", 53)
    assert parse_listen("::1", default_port=53) == ("::1", 53)
    assert parse_listen("[::1]", default_port=53) == ("::1", 53)
    assert parse_listen("127.0.0.1:5353", default_port=53) == ("127.0.0.1", 5353)


@pytest.mark.parametrize(
    ("yaml_text", "key"),
    [
        ("gateway: {proxy_listen: ['host']}\n", "gateway.proxy_listen.0"),
        ("gateway: {transparent_listen: ['0.0.0.0:15001', '0.0.0.0:x']}\n",
         "gateway.transparent_listen.1"),
        ("gateway: {metrics_listen: '127.0.0.1:70000'}\n", "gateway.metrics_listen"),
        ("gateway: {resolvers: ['dns.example:53']}\n", "gateway.resolvers.0"),
        ("dns: {listen: ['0.0.0.0']}\n", "dns.listen.0"),
        ("broker: {listen: '::1:8081'}\n", "broker.listen"),
        ("broker: {metrics_listen: 'nope'}\n", "broker.metrics_listen"),
    ],
)
def test_bad_listen_is_a_config_error(tmp_path: Path, yaml_text: str, key: str) -> None:
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert str(err.value).startswith(f"{cfg}: {key}: ")
    assert "\n" not in str(err.value) and "Value error" not in str(err.value)


def test_good_listen_addresses_load(tmp_path: Path) -> None:
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(
        "gateway: {transparent_listen: ['[::]:0'], proxy_listen: ['localhost:3128'],"
        " resolvers: ['127.0.0.53', '[::1]:5353', '::1']}\n"
        "dns: {listen: ['127.0.0.1:0']}\n"
        "broker: {metrics_listen: ''}\n"  # an empty broker metrics address turns it off
    )
    c = load_config(cfg)
    assert c.gateway.transparent_listen == ["[::]:0"]
    assert c.broker.metrics_listen == ""
    # and the defaults themselves are valid (they are validated only when given)
    defaults = load_config(None)
    for addr in (*defaults.gateway.transparent_listen, *defaults.gateway.proxy_listen,
                 defaults.gateway.metrics_listen, *defaults.dns.listen,
                 defaults.broker.listen, defaults.broker.metrics_listen):
        parse_listen(addr)


def test_gateway_serve_with_bad_listen_exits_2_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("gateway: {proxy_listen: ['host']}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    r = subprocess.run(
        [sys.executable, "-m", "stockade", "gateway", "serve", "--no-dns", "--config", str(cfg)],
        capture_output=True, text=True, timeout=60,
    )
    assert (r.returncode, r.stderr) == (2, f"stockade gateway: {err.value}\n")
    assert r.stderr.startswith(f"stockade gateway: {cfg}: gateway.proxy_listen.0: ")

"""deploy/nftables/stockade-host.nft: matches the example config and passes `nft -c`."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from deploy_support import DEPLOY, EXAMPLE_CONFIG, tool

from stockade.config import load_config

HOST_NFT = DEPLOY / "nftables" / "stockade-host.nft"


def _port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def test_host_table_matches_the_config() -> None:
    cfg = load_config(EXAMPLE_CONFIG)
    text = "\n".join(
        line for line in HOST_NFT.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    assert "flush" not in text
    tables = set(re.findall(r"^\s*(?:table|delete table)\s+\w+\s+(\S+)", text, re.M))
    assert tables == {"stockade_host"}, "only our own table"
    (pool,) = re.findall(r"elements = \{ ([^}]+) \}", text)
    assert pool.strip() == cfg.launcher.address_pool
    sandbox_ports = {
        _port(a) for a in (*cfg.gateway.transparent_listen, *cfg.dns.listen, cfg.broker.listen)
    }
    accepted = re.search(r"tcp dport \{ ([^}]+) \} ip saddr @sandbox_pool accept", text)
    assert accepted is not None
    assert {int(p) for p in accepted.group(1).split(",")} == sandbox_ports
    local_ports = {
        _port(a)
        for a in (*cfg.gateway.proxy_listen, cfg.gateway.metrics_listen, cfg.broker.metrics_listen)
    }
    dropped = {int(p) for m in re.findall(r"tcp dport \{ ([^}]+) \} drop", text)
               for p in m.split(",")}  # fmt: skip
    assert local_ports | sandbox_ports <= dropped


def test_nft_check(tmp_path: object) -> None:
    nft = tool("nft", "STOCKADE_NFT")
    if nft is None or os.geteuid() != 0:
        pytest.skip("nft -c needs nftables and root")
    proc = subprocess.run([nft, "-c", "-f", str(HOST_NFT)], capture_output=True, text=True,
                          check=False)  # fmt: skip
    if "Operation not permitted" in proc.stderr:
        pytest.skip("no CAP_NET_ADMIN here")
    assert proc.returncode == 0, proc.stderr

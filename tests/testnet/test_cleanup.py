"""Nothing is left behind: normal stop, failed start, SIGTERM, SIGKILL (+ reaping)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import dns.message
import dns.query
import pytest

from stockade.testing.testnet import ClientNamespace, FakeInternet, TestnetError, reap_stale
from stockade.testing.testnet.host import (
    NETNS_ETC,
    STATE_DIR,
    link_exists,
    netns_exists,
    nft_table_exists,
)

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("netns_available")]


def assert_gone(netns: str, link: str, table: str | None = None) -> None:
    assert not netns_exists(netns)
    assert not link_exists(link)
    assert not (NETNS_ETC / netns).exists()
    assert not (STATE_DIR / f"{netns}.json").exists()
    if table:
        assert not nft_table_exists("inet", table)


def test_stop_removes_everything_and_is_idempotent(fake_internet: FakeInternet) -> None:
    # taken: must move to a free subnet
    fi = FakeInternet(fake_internet.subnet, extra_records={"extra.test": [("TXT", "x1")]})
    with fi:
        assert fi.subnet != fake_internet.subnet
        reply = dns.query.udp(dns.message.make_query("extra.test", "TXT"), fi.dns_server,
                              timeout=10)
        assert [rd.to_text() for rrset in reply.answer for rd in rrset] == ['"x1"']
        assert netns_exists(fi.namespace) and link_exists(fi.host_if)
        workdir = fi.workdir
    assert_gone(fi.namespace, fi.host_if)
    assert not workdir.exists()
    fi.stop()
    assert_gone(fi.namespace, fi.host_if)


def test_failed_start_cleans_up() -> None:
    fi = FakeInternet(python="/bin/false", ready_timeout=10)
    with pytest.raises(TestnetError, match="exited"):
        fi.start()
    assert_gone(fi.namespace, fi.host_if)


def test_client_namespace_stop() -> None:
    c = ClientNamespace(f"cleanup{os.getpid()}", None, 15001, 15053)
    with c:
        assert nft_table_exists("inet", c.nft_table)
        assert c.run(["true"]).returncode == 0
    assert_gone(c.namespace, c.host_if, c.nft_table)
    c.stop()
    with pytest.raises(RuntimeError):
        c.run(["true"])


_CHILD = textwrap.dedent(
    """
    import sys, time
    from stockade.testing.testnet import ClientNamespace, FakeInternet
    fi = FakeInternet().start()
    c = ClientNamespace(sys.argv[1], None, 15001, 15053).start()
    print(fi.namespace, fi.host_if, c.namespace, c.host_if, c.nft_table, flush=True)
    time.sleep(600)
    """
)


def _start_child(suffix: str) -> tuple[subprocess.Popen[str], list[str]]:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, suffix], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    names = child.stdout.readline().split()
    assert len(names) == 5, "child did not start"
    return child, names


def test_sigterm_runs_cleanup() -> None:
    child, (ns, hif, cns, chif, table) = _start_child(f"term{os.getpid()}")
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    assert_gone(ns, hif)
    assert_gone(cns, chif, table)


def test_sigkill_leftovers_are_reaped() -> None:
    child, (ns, hif, cns, chif, table) = _start_child(f"kill{os.getpid()}")
    child.kill()
    child.wait(timeout=60)
    # nothing could run on SIGKILL; the reaper (ours, or a concurrent run's start()) removes
    # what the dead owner recorded
    reap_stale()
    assert_gone(ns, hif)
    assert_gone(cns, chif, table)


def test_reap_ignores_live_owners(fake_internet: FakeInternet) -> None:
    reap_stale()
    assert netns_exists(fake_internet.namespace)
    assert Path(fake_internet.ca_pem).exists()


def test_command_line_print_only() -> None:
    out = subprocess.run([sys.executable, "-m", "stockade.testing.testnet", "--print-only"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["addresses"]["allowed.test"].endswith(".10")
    assert_gone(doc["namespace"], doc["namespace"])

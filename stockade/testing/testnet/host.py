"""Host-side plumbing shared by FakeInternet and ClientNamespace.

Runs `ip`/`nft` (the tools are the interface; pyroute2 would be one more dependency for
a handful of commands), serialises address allocation between concurrent test runs
with a file lock, and keeps one cleanup registry that runs at exit and on SIGTERM/SIGHUP
so a killed test run does not leave namespaces, interfaces or nft tables behind. Each
object also records its owner pid in a state file, so resources of a run that died
with SIGKILL are reaped by the next run (`reap_stale`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

from stockade.procs import pid_alive

STATE_DIR = Path(os.environ.get("STOCKADE_TESTNET_STATE", "/run/stockade-testnet"))
_LOCK_FILE = "alloc.lock"


class TestnetError(RuntimeError):
    """Setting up the fake internet or a client namespace failed."""

    __test__ = False  # not a pytest test class despite the name


def run(argv: Sequence[str], *, check: bool = True, input: str | None = None) -> str:
    """Run a host command; raise TestnetError with its stderr when `check` and it fails."""
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise TestnetError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, nftables)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` not installed"
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"`ip netns` unavailable: {proc.stderr.strip()}"
    return None


@contextlib.contextmanager
def alloc_lock() -> Iterator[None]:
    """Held from choosing addresses until they are configured, so two concurrent runs
    never pick the same subnet."""
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(STATE_DIR / _LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def used_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every network the host has a route or an address in (all routing tables)."""
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for fam in ("-4", "-6"):
        for r in json.loads(run(["ip", "-j", fam, "route", "show", "table", "all"]) or "[]"):
            dst = r.get("dst", "")
            if not dst or dst == "default" or r.get("type") in ("broadcast", "multicast"):
                continue
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(dst, strict=False))
        for link in json.loads(run(["ip", "-j", fam, "addr", "show"]) or "[]"):
            for a in link.get("addr_info", []):
                with contextlib.suppress(ValueError, KeyError):
                    cidr = f"{a['local']}/{a['prefixlen']}"
                    nets.append(ipaddress.ip_network(cidr, strict=False))
    return nets


def netns_exists(name: str) -> bool:
    return (Path("/run/netns") / name).exists()


def link_exists(name: str, netns: str | None = None) -> bool:
    argv = ["ip", *(["-n", netns] if netns else []), "link", "show", "dev", name]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def nft_table_exists(family: str, table: str) -> bool:
    argv = ["nft", "list", "table", family, table]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


NETNS_ETC = Path("/etc/netns")


def write_resolv_conf(netns: str, nameserver: str) -> None:
    """`ip netns exec` bind-mounts /etc/netns/<ns>/resolv.conf over /etc/resolv.conf, so
    ordinary clients (pip, curl, getaddrinfo) in the namespace ask the fake DNS."""
    d = NETNS_ETC / netns
    d.mkdir(parents=True, exist_ok=True)
    (d / "resolv.conf").write_text(f"nameserver {nameserver}\noptions timeout:2 attempts:2\n")


def remove_resources(netns: str | None, links: Sequence[str], nft_tables: Sequence[str]) -> None:
    """Delete what one object created; every step tolerates 'already gone'."""
    if netns:
        shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
    for table in nft_tables:
        if nft_table_exists("inet", table):
            run(["nft", "delete", "table", "inet", table], check=False)
    if netns and netns_exists(netns):
        run(["ip", "netns", "del", netns], check=False)
    for link in links:
        if link_exists(link):
            run(["ip", "link", "del", link], check=False)


def forget_flows(address: str) -> None:
    """Delete the host's conntrack entries to or from `address`. An entry outlives the
    namespace that made it (30 s and more), and keeps its NAT mapping: a new client on
    the same address whose source port matches would be redirected to the old, closed
    port and its datagram lost."""
    if shutil.which("conntrack") is None:
        raise TestnetError("`conntrack` not installed (scripts/bootstrap.sh installs it)")
    for side in ("--orig-src", "--orig-dst"):
        # exit status 1 when nothing matched: not an error
        run(["conntrack", "-D", side, address], check=False)


# --- owner records: let the next run reap what a SIGKILLed run left behind ---------


def write_owner(
    key: str, netns: str | None, links: Sequence[str], nft_tables: Sequence[str]
) -> None:
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "netns": netns, "links": list(links), "nft": list(nft_tables)}
    (STATE_DIR / f"{key}.json").write_text(json.dumps(record))


def drop_owner(key: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{key}.json").unlink()


def reap_stale() -> list[str]:
    """Remove resources recorded by processes that no longer exist. Only touches what an
    owner record names, i.e. what this module created."""
    reaped: list[str] = []
    if not STATE_DIR.is_dir():
        return reaped
    for f in STATE_DIR.glob("*.json"):
        try:
            rec = json.loads(f.read_text())
            pid = int(rec["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_alive(pid):
            continue
        remove_resources(rec.get("netns"), rec.get("links", []), rec.get("nft", []))
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
        reaped.append(f.stem)
    return reaped


# --- cleanup registry -----------------------------------------------------------------

_cleanups: dict[int, Callable[[], None]] = {}
_reg_lock = threading.RLock()  # reentrant: _run_all runs from signal handlers too
_installed = False


def _run_all() -> None:
    with _reg_lock:
        fns = list(_cleanups.values())
    for fn in reversed(fns):
        with contextlib.suppress(Exception):
            fn()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _run_all()
    # then die of the same signal, as if we had not been here
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def register_cleanup(obj: object, fn: Callable[[], None]) -> None:
    """Run `fn` at interpreter exit or on SIGTERM/SIGHUP unless unregistered first."""
    global _installed
    with _reg_lock:
        _cleanups[id(obj)] = fn
        if _installed:
            return
        _installed = True
    atexit.register(_run_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            # only where nobody else (pytest, an asyncio app) has claimed the signal
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


def unregister_cleanup(obj: object) -> None:
    with _reg_lock:
        _cleanups.pop(id(obj), None)

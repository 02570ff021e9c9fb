"""The sandboxed command's environment: the host's allowlisted variables, the trust
bundle's, the caller's, then the launcher's own (PATH, HOME, the broker, the proxy)."""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from . import initscript

if TYPE_CHECKING:  # annotations only
    from .spec import SandboxSpec

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# removed from every sandbox's environment (whatever the allowlist or SandboxSpec.env say);
# a `proxy_env` profile then gets the launcher's own values for the first six
PROXY_ENV_NAMES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY",
                   "no_proxy", "ALL_PROXY", "all_proxy")


def port(listen: str) -> int:
    return int(listen.rsplit(":", 1)[1])


def proxy_listen_problem(proxy_listen: list[str]) -> str | None:
    """Why a `proxy_env` sandbox cannot use `gateway.proxy_listen`, or None (pure).

    The sandbox dials `<host-side veth address>:<port of proxy_listen[0]>` without any
    redirect, so the listener must be bound to every IPv4 address of the host: 0.0.0.0.
    """
    if not proxy_listen:
        return ("gateway.proxy_listen is empty: a proxy_env profile needs the gateway's "
                "explicit proxy listener on 0.0.0.0:<port>")
    listen = proxy_listen[0]
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "0.0.0.0":  # noqa: S104 - required: sandboxes reach it on their veth address
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    what = "loopback only" if loopback else "not every IPv4 address of the host"
    return (f"gateway.proxy_listen[0] is {listen} ({what}): a proxy_env profile reaches the "
            "explicit proxy on the sandbox's host-side veth address, so the gateway must "
            f"listen on 0.0.0.0:{port(listen)}")


def permitted_congestion_control(name: str | None) -> str | None:
    """`name` if a network namespace may make it its default, else None (with a warning):
    outside the initial namespace the kernel refuses what tcp_allowed_congestion_control
    does not list (reno is always allowed)."""
    if not name or name == "reno":
        return name
    try:
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    except OSError:
        return name  # cannot tell: the init's write is best effort anyway
    if name in allowed:
        return name
    logging.getLogger("stockade.launcher").warning(
        "launcher.congestion_control %r is not in net.ipv4.tcp_allowed_congestion_control "
        "(%s): sandboxes keep the host's default", name, " ".join(allowed))
    return None


def sandbox_env(spec: SandboxSpec, host_ip: str, allowlist: list[str], broker_port: int,
                proxy_port: int | None, trust: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment. `proxy_port` (a profile's `egress.proxy_env`): point
    HTTP(S)_PROXY at the gateway's explicit proxy on the host-side veth address (the
    nft exemption of `SET_PROXY` lets exactly that through); the broker stays direct."""
    env = {k: os.environ[k] for k in allowlist if k in os.environ}
    env.update(trust or {})  # before spec.env: a task's own CA for a private mirror wins
    env.update(spec.env)
    env.update({
        "PATH": SANDBOX_PATH,
        "HOME": f"{initscript.SCRATCH}/home",
        "TMPDIR": "/tmp",  # noqa: S108 - the sandbox's own /tmp (in scratch)
        "STOCKADE_BROKER": f"http://{host_ip}:{broker_port}",
    })
    for k in PROXY_ENV_NAMES:
        env.pop(k, None)
    if proxy_port is not None:
        url = f"http://{host_ip}:{proxy_port}"
        env.update({"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url,
                    "https_proxy": url, "NO_PROXY": host_ip, "no_proxy": host_ip})
    return env


# what the launcher sets in every sandbox's environment: an exec's additions never change it
LAUNCHER_ENV_NAMES = ("PATH", "HOME", "TMPDIR", "STOCKADE_BROKER", *PROXY_ENV_NAMES)


def exec_env(base: dict[str, str], additions: dict[str, str]) -> dict[str, str]:
    """The environment of one more command in a session (pure): the sandbox's own
    (`base`, built by `sandbox_env`) with the caller's additions, except the launcher's."""
    return {**base, **{k: v for k, v in additions.items() if k not in LAUNCHER_ENV_NAMES}}

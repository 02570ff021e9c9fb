"""Output scrubbing (pure): host paths, host environment values, the host name and
infrastructure addresses in a sandbox's stdout/stderr become placeholders before they
leave the launcher. Longest secret first, so a path inside another is not half-replaced.

Only host-specific values are replaced: a value that is a public, well-known system path
(`/etc/ssl/certs` in `SSL_CERT_DIR`, `/usr/lib` in a library path, `/tmp`, `/`) is the same
on every Debian host and inside the sandbox, so replacing it would only garble the output.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MIN_ENV_VALUE = 6  # shorter values ("1", "yes", "C") would shred ordinary output
# environment variables whose values are plain words also found in any output
ENV_SKIP = frozenset({"PATH", "LANG", "LC_ALL", "TERM", "TZ", "SHELL", "SHLVL", "PWD",
                      "OLDPWD", "_", "LOGNAME", "USER", "COLUMNS", "LINES"})
# trees that hold the same files on every host (and are bound read-only into the sandbox)
PUBLIC_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/proc", "/sys", "/dev")
# directories whose name is public but whose subdirectories may be host-specific
# world-writable scratch inside the public trees, like /tmp: what is below is the host's
SCRATCH_IN_TREES = ("/dev/shm", "/dev/mqueue")  # noqa: S108 - names, not files we use
PUBLIC_DIRS = frozenset({"/", "/tmp", "/var/tmp", "/var", "/var/lib", "/var/log", "/run",  # noqa: S108 - names, not files we use
                         "/opt", "/home", "/root", "/srv", "/mnt", "/media",
                         *SCRATCH_IN_TREES})


def is_public_path(value: str) -> bool:
    """True for a well-known system path, or a `:`-list of them (pure).

    `/etc/ssl/certs` and `/usr/lib` are public; `/tmp` is, `/tmp/stockade-1234` is not.
    """
    parts = value.split(":")
    return all(_public_one(p) for p in parts) and any(parts)


def _public_one(path: str) -> bool:
    parts = [p for p in path.split("/") if p]
    if not path.startswith("/") or any(p in (".", "..") for p in parts):
        return False  # `/usr/../home/alice` is not under /usr
    norm = "/" + "/".join(parts)  # `//usr/` -> `/usr`
    if norm in PUBLIC_DIRS:
        return True
    if any(norm.startswith(d + "/") for d in SCRATCH_IN_TREES):
        return False  # `/dev/shm/stockade-run` is a host's run dir, not a system path
    return any(norm == t or norm.startswith(t + "/") for t in PUBLIC_TREES)


@dataclass(frozen=True, slots=True)
class Scrubber:
    pairs: tuple[tuple[str, str], ...]  # (literal, placeholder), longest literal first
    hostnames: tuple[str, ...] = ()

    def __call__(self, text: str) -> str:
        return scrub(text, self)


def build(
    *,
    host_paths: Iterable[str] = (),
    host_env: Mapping[str, str] | None = None,
    hostnames: Iterable[str] = (),
    addresses: Iterable[str] = (),
) -> Scrubber:
    pairs: dict[str, str] = {}
    for name, value in (host_env or {}).items():
        if name in ENV_SKIP or len(value) < MIN_ENV_VALUE or is_public_path(value):
            continue
        pairs.setdefault(value, f"<env:{name}>")
    for p in host_paths:
        p = p.rstrip("/")
        if len(p) > 1 and not is_public_path(p):
            pairs[p] = "<host-path>"
    for a in addresses:
        if a and a not in ("0.0.0.0", "::"):  # noqa: S104 - wildcard, not an address
            pairs[a] = "<infra-address>"
    ordered = tuple(sorted(pairs.items(), key=lambda kv: (-len(kv[0]), kv[0])))
    names = tuple(sorted({h for h in hostnames if len(h) >= 2}, key=len, reverse=True))
    return Scrubber(ordered, names)


def scrub(text: str, s: Scrubber) -> str:
    return scrub_names(scrub_literals(text, s), s)


def scrub_literals(text: str, s: Scrubber) -> str:
    """The first pass: paths, environment values, addresses."""
    if text and s.pairs:
        # one pass with an alternation keeps replacements from being re-scrubbed
        pattern = re.compile("|".join(re.escape(k) for k, _ in s.pairs))
        table = dict(s.pairs)
        text = pattern.sub(lambda m: _addr_guard(m, text, table), text)
    return text


def scrub_names(text: str, s: Scrubber) -> str:
    """The second pass, over the first one's output: the host's names."""
    for h in s.hostnames:
        text = re.sub(rf"(?<![\w.-]){re.escape(h)}(?![\w-])", "<hostname>", text,
                      flags=re.IGNORECASE)
    return text


def _addr_guard(m: re.Match[str], text: str, table: dict[str, str]) -> str:
    # an address must not match inside a longer number (10.0.0.1 inside 10.0.0.12)
    lit = m.group(0)
    ph = table[lit]
    if ph == "<infra-address>":
        end = m.end()
        start = m.start()
        if (end < len(text) and text[end].isdigit()) or (start > 0 and text[start - 1].isdigit()):
            return lit
    return ph


def for_sandbox(config: Any, scratch_base: str, host_ip: str, inputs: list[tuple[str, str]],
                spec_env: Mapping[str, str]) -> Scrubber:
    """The scrubber of one sandbox's output (the one function here that looks at the host:
    its directories, environment, names and the infrastructure's addresses)."""
    paths = [scratch_base, config.state_dir, config.log_dir, config.run_dir, os.getcwd(),
             os.path.expanduser("~")]
    paths += [os.path.realpath(h) for h, _ in inputs]
    addrs = [host_ip]
    for lst in (config.gateway.transparent_listen, config.dns.listen,
                [config.broker.listen], config.gateway.resolvers):
        for item in lst:
            addrs.append(item.rsplit(":", 1)[0] if item.count(":") == 1 else item)
    if config.vault.address:
        addrs.append(config.vault.address)
    host_env = {k: v for k, v in os.environ.items() if k not in spec_env}
    return build(host_paths=paths, host_env=host_env,
                 hostnames=[socket.gethostname(), socket.getfqdn()], addresses=addrs)

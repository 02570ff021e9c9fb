"""The keys of `stockade.yaml` that `stockade sandbox list|kill` read, checked by hand.

Why not the models: importing pydantic and building the events' and the launcher's models
was 80-90 ms of a kill whose target is 250 ms in all (bench/README.md, "sandbox kill:
the file without pydantic"). These commands read the top-level keys, the whole `events:`
section (the operator's event is written and signed with it) and, of `launcher:`,
`nft_table`, `cgroup_root`, `cgroup_parent` and `selftest`.

How it stays the models' equal: each of those keys is checked here with its model's
type, bounds, pattern and default, but only for a plain value (an unquoted YAML number,
bool or string of the field's type). Anything else (a quoted number pydantic would
coerce, an unknown key, a value out of range, a section that is no mapping) is not
decided here: the file goes to `configfile.LauncherFile`, which accepts it or refuses it
with its own error lines. So a value is never taken that the models refuse, nor refused
that they take, and the errors are theirs; tests/core/test_configpeek.py holds the tables
below to the models and compares the outcomes. Of the launcher's other keys only the
names are checked (a misspelt key is the models' to report); their values are unread
here, as the other components' sections are by `LauncherFile`: the launcher process that
uses them validated them.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from stockade.instance import PORT_SPAN, derive
from stockade.yamlfile import read_mapping

if TYPE_CHECKING:
    from stockade.events import EventWriter


class _Undecided(Exception):
    """A value this module does not decide: the models do (`load` falls back to them)."""


@dataclass(frozen=True)
class Num:
    """An int or float field with its model's bounds (None: unbounded); `optional`
    takes null."""

    kind: type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    optional: bool = False

    def check(self, v: Any) -> Any:
        if v is None and self.optional:
            return None
        # bool is an int to Python, but not a plain number of the file: the models decide
        if not (type(v) is int or (self.kind is float and type(v) is float)):
            raise _Undecided
        try:
            out = self.kind(v)
        except OverflowError:  # an int past any float
            raise _Undecided from None
        # written so that NaN fails every bound, as it does in the models
        if ((self.ge is not None and not out >= self.ge)
                or (self.gt is not None and not out > self.gt)
                or (self.le is not None and not out <= self.le)):
            raise _Undecided
        return out


@dataclass(frozen=True)
class Text:
    """A str field: `optional` takes null, `choices` a Literal's, `pattern` the model's;
    `ip` 4 or 6: an address, normalised as the model's validator does."""

    optional: bool = False
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    ip: int = 0

    def check(self, v: Any) -> Any:
        if v is None and self.optional:
            return None
        if type(v) is not str or (self.choices and v not in self.choices):
            raise _Undecided
        # the models' patterns are Rust regexes, whose `$` is the end of the text only
        if self.pattern is not None and ("\n" in v or not re.search(self.pattern, v)):
            raise _Undecided
        if self.ip:
            address = ipaddress.IPv4Address if self.ip == 4 else ipaddress.IPv6Address
            try:
                return str(address(v))
            except ValueError:
                raise _Undecided from None
        return v


class Flag:
    def check(self, v: Any) -> Any:
        if type(v) is not bool:
            raise _Undecided
        return v


Check = Num | Text | Flag
STR, OPT = Text(), Text(optional=True)
TOP: dict[str, tuple[Check, Any]] = {
    "rules_dir": (STR, "rules"), "state_dir": (STR, "/var/lib/stockade"),
    "log_dir": (STR, "/var/log/stockade"), "run_dir": (STR, "/run/stockade"),
    "base_port": (Num(int, ge=1, le=65536 - PORT_SPAN, optional=True), None),
    "upstream_ca_file": (OPT, None),
}
SECTIONS = ("events", "gateway", "dns", "broker", "vault", "launcher", "dev_vault", "stack")
EVENTS: dict[str, tuple[Check, Any]] = {
    "format": (Text(choices=("ecs", "ocsf")), "ecs"), "file": (OPT, None),
    "stdout": (Flag(), False), "max_bytes": (Num(int, gt=0), 50 * 2**20),
    "backups": (Num(int, ge=0), 5), "verbatim_per_key": (Num(int, ge=0), 20),
    "summary_window_s": (Num(float, gt=0), 60.0),
    "task_budget_events": (Num(int, ge=0), 2000),
    "task_budget_bytes": (Num(int, ge=0), 2 * 2**20), "keys_per_task": (Num(int, ge=1), 64),
    "task_dir": (OPT, None), "task_store_bytes": (Num(int, gt=0), 4 * 2**20),
    "task_retention_s": (Num(float, ge=0), 86400.0), "chain": (Flag(), True),
    "chain_dir": (OPT, None), "checkpoint_every": (Num(int, ge=1), 1000),
    "checkpoint_s": (Num(float, gt=0), 60.0),
}
LAUNCHER: dict[str, tuple[Check, Any]] = {
    "nft_table": (STR, "stockade"), "cgroup_root": (STR, "/sys/fs/cgroup"),
    "cgroup_parent": (Text(pattern=r"^[A-Za-z0-9_.-]+$"), "stockade"),
}
SELFTEST: dict[str, tuple[Check, Any]] = {
    "sample_rate": (Num(float, ge=0.0, le=1.0), 1.0), "raw_ip": (Text(ip=4), "192.0.2.1"),
    "outside_resolver": (Text(ip=4), "192.0.2.53"),
    "ipv6_address": (Text(ip=6), "2001:db8::1"),
    "probe_timeout_s": (Num(float, gt=0, le=30), 2.0),
    "evidence_timeout_s": (Num(float, gt=0, le=30), 10.0),
}
# the names of every launcher key (LauncherSettings' fields): one not among them is the
# models' to refuse; of these only LAUNCHER's and `selftest` are read here
LAUNCHER_KEYS = frozenset({
    "backend", "microvm", "gvisor", "pools", "selftest", "downgrade_isolation",
    "address_pool", "control_socket", "control_listen", "control_token_file", "control_host_paths",
    "control_tls_cert", "control_tls_key", "control_tls_client_ca", "scratch_dir",
    "nft_table", "nflog_group", "default_ttl_s", "reconcile_interval_s",
    "rules_poll_interval_s", "name_prefix", "cgroup_parent", "cgroup_cpu_weight",
    "cgroup_root", "sandbox_uid", "sandbox_gid", "max_output_bytes", "ro_binds",
    "etc_allowlist", "env_allowlist", "pids_fail_kill", "log_rate_per_s",
    "congestion_control", "rlimit_nofile", "rlimit_core", "rlimit_memlock", "init_python",
    "shm_size",
})


def _section(data: Any, table: dict[str, tuple[Check, Any]],
             others: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The table's keys of `data` checked (defaults for the missing ones); a key in
    neither the table nor `others` is undecided."""
    if not isinstance(data, dict) or not set(data) <= set(table) | others:
        raise _Undecided
    return {k: check.check(data[k]) if k in data else default
            for k, (check, default) in table.items()}


class FileViews:
    """What a loaded file derives from its keys (the events file, the task store, the
    writer), for `PeekedFile` and the models (`configfile.Shared`) alike."""

    if TYPE_CHECKING:
        events: Any
        launcher: Any
        log_dir: str

    @property
    def events_file(self) -> Path:
        return Path(self.events.file) if self.events.file else Path(self.log_dir) / "events.jsonl"

    @property
    def task_events_dir(self) -> Path:
        return (Path(self.events.task_dir) if self.events.task_dir
                else Path(self.log_dir) / "tasks")

    def event_writer(self, *, stdout: bool | None = None) -> EventWriter:
        """The writer every component uses: shared file, throttle, per-task store."""
        from stockade.events.fromsettings import writer_of
        from stockade.events.probemark import window_of

        ev = self.events
        return writer_of(ev, self.events_file, self.task_events_dir,
                         ev.stdout if stdout is None else stdout,
                         probes=window_of(self.launcher.selftest))


@dataclass(frozen=True)
class PeekedFile(FileViews):
    """What `sandbox list|kill` read of the file, with `LauncherFile`'s attribute names
    (`events` and `launcher` are namespaces of their keys)."""

    rules_dir: str
    state_dir: str
    log_dir: str
    run_dir: str
    base_port: int | None
    upstream_ca_file: str | None
    events: Any
    launcher: Any


def peek(data: dict[Any, Any]) -> PeekedFile | None:
    """The file's mapping (as read, before the derived defaults) checked; None when the
    models must decide it."""
    data = derive(data)
    try:
        top = _section(data, TOP, frozenset(SECTIONS))
        events = _section(data.get("events", {}), EVENTS)
        launcher_data = data.get("launcher", {})
        launcher = _section(launcher_data, LAUNCHER, LAUNCHER_KEYS)
        selftest = _section(launcher_data.get("selftest", {}), SELFTEST)
    except _Undecided:
        return None
    return PeekedFile(**top, events=SimpleNamespace(**events),
                      launcher=SimpleNamespace(**launcher, selftest=SimpleNamespace(**selftest)))


def load(path: str | Path | None) -> PeekedFile | None:
    """`stockade.yaml` for `sandbox list|kill` (None: the defaults); None when the
    models must decide it (the caller loads `configfile.LauncherFile` then). Raises
    yamlfile's ConfigError for a file that is no YAML mapping."""
    return peek(read_mapping(Path(path)) if path is not None else {})

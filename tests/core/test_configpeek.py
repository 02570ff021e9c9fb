"""`stockade sandbox list|kill` read stockade.yaml through configpeek, without pydantic:
its tables are the models' (the same keys, types, bounds, patterns and defaults), a value
it takes is the value the models make of it, and whatever it does not decide goes to
`LauncherFile`, whose verdict and error lines are then the command's."""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Any

import annotated_types as at
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from stockade.launcher.settings import LauncherSettings, SelftestSettings

from stockade import configpeek as cp
from stockade.cli import config_or_fail
from stockade.configfile import LauncherFile, load_as
from stockade.events.probemark import window_of
from stockade.events.settings import EventSettings
from stockade.yamlfile import ConfigError

TABLES: list[tuple[dict[str, Any], type[BaseModel]]] = [
    (cp.EVENTS, EventSettings), (cp.SELFTEST, SelftestSettings)]


def _bounds(model: type[BaseModel], name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in model.model_fields[name].metadata:
        for kind in ("ge", "gt", "le"):
            if isinstance(m, getattr(at, kind.capitalize())):
                out[kind] = getattr(m, kind)
        if hasattr(m, "pattern") and m.pattern is not None:
            out["pattern"] = m.pattern
    return out


def _same_field(check: Any, default: Any, model: type[BaseModel], name: str) -> None:
    field = model.model_fields[name]
    assert field.default == default, name
    bounds = _bounds(model, name)
    ann = field.annotation
    if isinstance(check, cp.Num):
        args = typing.get_args(ann)
        assert check.kind in (ann, *args) and check.optional == (type(None) in args), name
        assert {k: getattr(check, k) for k in ("ge", "gt", "le")
                if getattr(check, k) is not None} == bounds, name
    elif isinstance(check, cp.Flag):
        assert ann is bool, name
    else:
        assert isinstance(check, cp.Text)
        if typing.get_origin(ann) is typing.Literal:
            assert check.choices == typing.get_args(ann), name
        else:
            assert (ann is str) != check.optional, name
            assert ann in (str, str | None), name
        assert check.pattern == bounds.get("pattern"), name


def test_the_tables_are_the_models() -> None:
    for table, model in TABLES:
        assert list(table) == list(model.model_fields)
        for name, (check, default) in table.items():
            _same_field(check, default, model, name)
    for name, (check, default) in cp.LAUNCHER.items():
        _same_field(check, default, LauncherSettings, name)
    shared = [k for k in LauncherFile.model_fields if k not in cp.SECTIONS]
    assert list(cp.TOP) == shared
    for name, (check, default) in cp.TOP.items():
        _same_field(check, default, LauncherFile, name)
    assert set(cp.SECTIONS) | set(cp.TOP) == set(LauncherFile.model_fields)
    assert set(LauncherSettings.model_fields) == cp.LAUNCHER_KEYS


def _peeked(f: Any) -> dict[str, Any]:
    """Every value configpeek reads, of a PeekedFile or a LauncherFile alike."""
    out = {k: getattr(f, k) for k in cp.TOP}
    out |= {f"events.{k}": getattr(f.events, k) for k in cp.EVENTS}
    out |= {f"launcher.{k}": getattr(f.launcher, k) for k in cp.LAUNCHER}
    out |= {f"selftest.{k}": getattr(f.launcher.selftest, k) for k in cp.SELFTEST}
    out |= {"events_file": f.events_file, "task_events_dir": f.task_events_dir,
            "window": window_of(f.launcher.selftest)}
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        x, y = a[k], b[k]
        assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), k
        assert type(x) is type(y), k


# values as a YAML file gives them: plain ones of every type, those at the models' bounds,
# and the forms pydantic coerces or refuses (quoted numbers and bools, bytes, lists, maps,
# NaN, infinities)
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(), st.floats(),
    st.floats(-1.0, 31.0),
    st.sampled_from([29.999, 30, 30.0, 30.001, 65529, 65530, 1.0, -0.0, 2**70, 10**400]),
    st.sampled_from(["", "ecs", "ocsf", "ECS", "1", " 2 ", "1.5", "true", "no", "stockade",
                     "a/b", "x\n", "bad name", "a.b-c_1", "192.0.2.1", "192.000.2.1", "::1",
                     "2001:DB8::1", "::ffff:192.0.2.1", "1.2.3", "/tmp/x", "inf", "nan"]),
    st.text(max_size=6), st.binary(max_size=3),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.none(),
                                                         max_size=1))
SECTION_OF = {"events": cp.EVENTS, "launcher": cp.LAUNCHER, "selftest": cp.SELFTEST}
# (section, key): None is the top level; a key of no table is an unknown (or unread) one
KEYS = st.one_of(
    st.sampled_from([(None, k) for k in [*cp.TOP, "gatway", "gateway", "events", "launcher"]]),
    *(st.sampled_from([(sec, k) for k in [*table, "no_such_key"]])
      for sec, table in SECTION_OF.items()),
    st.just(("launcher", "selftest")))  # unread launcher keys: see the last test


def _file(probes: list[tuple[tuple[str | None, str], Any]], defaults: bool) -> dict[str, Any]:
    """A file of valid values (the defaults, written out or left out), with `probes` set."""
    data: dict[str, Any] = {}
    if defaults:
        data = {k: d for k, (_, d) in cp.TOP.items()}
        data["events"] = {k: d for k, (_, d) in cp.EVENTS.items()}
        data["launcher"] = {k: d for k, (_, d) in cp.LAUNCHER.items()}
        data["launcher"]["selftest"] = {k: d for k, (_, d) in cp.SELFTEST.items()}
    for (section, key), value in probes:
        if section is None:
            data[key] = value
            continue
        parent = data.setdefault("launcher", {}) if section == "selftest" else data
        name = "selftest" if section == "selftest" else section
        if not isinstance(parent, dict):
            continue
        if not isinstance(parent.get(name), dict):
            parent[name] = {}
        parent[name][key] = value
    return data


def _plain(section: str | None, key: str, value: Any) -> bool:
    """The value is of its field's own type (what configpeek decides by itself)."""
    table = SECTION_OF.get(section or "", cp.TOP)
    if key not in table:
        return False
    check = table[key][0]
    if value is None:
        return getattr(check, "optional", False)
    if isinstance(check, cp.Num):
        return type(value) is int or (check.kind is float and type(value) is float)
    return type(value) is (bool if isinstance(check, cp.Flag) else str)


def _decides_as_the_models(probes: list[Any], defaults: bool) -> None:
    data = _file(probes, defaults)
    found = cp.peek(data)
    try:
        full = LauncherFile.model_validate(data)
    except ValidationError:
        assert found is None, data
        return
    if found is not None:
        _same(_peeked(found), _peeked(full))
    elif all(_plain(sec, key, v) for (sec, key), v in probes):
        raise AssertionError(f"plain values the models take left to them: {data}")


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=2), st.booleans())
def test_it_decides_as_the_models_do(probes: list[Any], defaults: bool) -> None:
    """A file configpeek takes, the models take with the same values; a file of plain
    values the models take, configpeek decides by itself; all else is the models'."""
    _decides_as_the_models(probes, defaults)


@pytest.mark.parametrize(("where", "value"), [
    (("launcher", "cgroup_parent"), "x\n"),  # Python's `$` matches before it, Rust's not
    (("launcher", "cgroup_parent"), "a\nb"),
    (("events", "summary_window_s"), 10**400),  # no float: the models refuse it
    (("events", "summary_window_s"), float("inf")),
    (("events", "summary_window_s"), float("nan")),
    (("selftest", "probe_timeout_s"), float("inf")),
    (("selftest", "probe_timeout_s"), 30), (("selftest", "probe_timeout_s"), 30.0001),
    (("selftest", "sample_rate"), 0), (("events", "backups"), True),
    (("events", "backups"), 1.0), (("events", "chain"), 1), (("events", "format"), "ECS"),
    ((None, "base_port"), 65529), ((None, "base_port"), 65530), ((None, "base_port"), 0),
    (("selftest", "raw_ip"), "::ffff:192.0.2.1"), (("selftest", "ipv6_address"), "192.0.2.1"),
    (("selftest", "ipv6_address"), "2001:DB8:0::1"), (("selftest", "raw_ip"), "01.2.3.4"),
])
def test_the_edges_are_decided_as_the_models_do(where: tuple[str | None, str],
                                                 value: Any) -> None:
    for defaults in (False, True):
        _decides_as_the_models([(where, value)], defaults)


def test_the_defaults_and_a_bench_file(tmp_path: Path) -> None:
    assert isinstance(cp.load(None), cp.PeekedFile)
    _same(_peeked(cp.load(None)), _peeked(LauncherFile()))
    p = tmp_path / "stockade.yaml"
    p.write_text(yaml.safe_dump({
        "state_dir": "/tmp/s", "log_dir": "/tmp/l", "run_dir": "/tmp/r", "base_port": 20000,
        "events": {"file": "/tmp/e.jsonl", "format": "ocsf", "checkpoint_s": 5},
        "gateway": {"control_socket": "/tmp/gw.sock"},
        "launcher": {"nft_table": "t1", "cgroup_parent": "p1", "address_pool": "10.9.0.0/22",
                     "nflog_group": 7001, "selftest": {"sample_rate": 0, "raw_ip": "192.0.2.7"}},
    }))
    found = cp.load(p)
    assert found is not None
    full = load_as(LauncherFile, p)
    _same(_peeked(found), _peeked(full))
    assert found.events.chain_dir == full.events.chain_dir == "/tmp/s/events-chain"
    assert window_of(found.launcher.selftest) == full.launcher.selftest.window()


def test_a_coerced_value_is_the_models(tmp_path: Path) -> None:
    """A quoted number is no plain value: the models coerce it, and the command gets
    their file (LauncherFile) with their value."""
    p = tmp_path / "stockade.yaml"
    p.write_text("events: {backups: '7'}\nlauncher: {selftest: {probe_timeout_s: '1.5'}}\n")
    assert cp.load(p) is None
    found = config_or_fail(str(p), "sandbox kill", peek=True)
    assert isinstance(found, LauncherFile)
    assert found.events.backups == 7 and found.launcher.selftest.probe_timeout_s == 1.5


def test_the_launchers_other_values_are_unread(tmp_path: Path) -> None:
    """As `LauncherFile` leaves the other components' sections unread, configpeek leaves
    the launcher keys a kill does not use: a kill of a running sandbox is not refused
    for a value its launcher validated when it started (a misspelt name still is)."""
    p = tmp_path / "stockade.yaml"
    p.write_text("launcher: {nflog_group: -1, nft_table: t2}\n")
    with pytest.raises(ConfigError, match="nflog_group"):
        load_as(LauncherFile, p)
    found = cp.load(p)
    assert found is not None and found.launcher.nft_table == "t2"

"""deploy/logging: Vector and Fluent Bit tail the files the EventWriter writes (and rotates),
and ship each event with its ECS fields intact. Vector's VRL programs are executed on real
events when the `vrl_python` bindings are installed; otherwise the checks are structural."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import socket
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from deploy_support import EXAMPLE_CONFIG, FLUENT_BIT, VECTOR
from sample_events import broker_call, bypass_attempt, denial, dns_decision

from stockade.config import load_config
from stockade.events import EventWriter, make_event, read_events, validate


@pytest.fixture(scope="module")
def vector() -> dict[str, Any]:
    return tomllib.loads(VECTOR.read_text())


@pytest.fixture(scope="module")
def events_file() -> Path:
    return Path(load_config(EXAMPLE_CONFIG).events_file)


def _sample_events() -> list[dict[str, Any]]:
    evs = [
        denial(reason="destination_mismatch", rule_id="pypi", source_port=40000,
               destination_domain="pypi.org", destination_ip="151.101.0.223",
               message="SNI pypi.org != Host evil.example", extra={"listener": "transparent"}),
        dns_decision("a9f3k2j4h5g6f7d8.evil.example", "TXT", decision="denied",
                     reason="high_entropy_label", task_id="t-1", profile="pypi-build",
                     source_ip="10.213.0.2", transport="udp", protocol="dns",
                     dns_response_code="REFUSED"),
        bypass_attempt(reason="bypass_attempt", task_id="t-1", source_ip="10.213.0.2",
                       destination_ip="8.8.8.8", destination_port=53, transport="udp"),
        make_event(
            component="broker",
            action="vault_status",
            reason="vault_unavailable",
            message="vault down (connection refused)",
        ),
        broker_call(
            decision="allowed",
            reason="allowed_by_rule",
            task_id="t-2",
            profile="github-readonly",
            http_method="GET",
            http_status=200,
            url={"path": "/repos/x/y"},
            extra={"api": "github", "bytes_up": 0, "bytes_down": 512, "latency_ms": 12.5},
        ),
    ]
    for ev in evs:
        validate(ev)
    return evs


def _shipped_names(tmp_path: Path, pattern: str) -> set[str]:
    """Files the EventWriter leaves after rotating, that `pattern` (the shipper's glob on
    the configured events file) matches."""
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, max_bytes=600, backups=3)
    for _ in range(6):
        for ev in _sample_events():
            writer.write(ev)
    writer.close()
    names = {p.name for p in tmp_path.iterdir()}
    assert {"events.jsonl", "events.jsonl.1", "events.jsonl.3"} <= names
    glob = Path(pattern).name
    return {n for n in names if fnmatch.fnmatch(n, glob)}


# -- Vector ---------------------------------------------------------------------------------
def test_vector_graph_is_connected(vector: dict[str, Any]) -> None:
    components = set(vector["sources"]) | set(vector["transforms"])
    outputs = set(components)
    for name, t in vector["transforms"].items():
        if t.get("reroute_dropped"):
            outputs.add(f"{name}.dropped")
    used: set[str] = set()
    for kind in ("transforms", "sinks"):
        for name, comp in vector[kind].items():
            assert comp["inputs"], f"{kind}.{name} has no inputs"
            for inp in comp["inputs"]:
                assert inp in outputs, f"{kind}.{name}: unknown input {inp}"
                used.add(inp.split(".")[0])
    assert components <= used, f"unused: {components - used}"


def test_vector_tails_the_events_file_and_its_rotations(
    vector: dict[str, Any], events_file: Path, tmp_path: Path
) -> None:
    (src,) = [s for s in vector["sources"].values() if s["type"] == "file"]
    (pattern,) = src["include"]
    assert Path(pattern).parent == events_file.parent
    shipped = _shipped_names(tmp_path, pattern)
    assert {"events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3"} <= shipped
    assert src["fingerprint"]["strategy"] == "checksum", "rename rotation must not re-ship"


def test_vector_sinks_ship_json(vector: dict[str, Any]) -> None:
    for name, sink in vector["sinks"].items():
        if sink["type"] == "prometheus_exporter":
            host = sink["address"].rpartition(":")[0]
            assert host == "127.0.0.1", "event metrics stay on the host"
            continue
        assert sink["encoding"]["codec"] == "json", name


def test_vector_metric_labels_are_bounded(vector: dict[str, Any]) -> None:
    """Never a task id, name or address as a label: those are unbounded."""
    (counts,) = [t for t in vector["transforms"].values() if t["type"] == "log_to_metric"]
    (metric,) = counts["metrics"]
    assert (metric["namespace"], metric["name"], metric["type"]) == (
        "stockade",
        "events_total",
        "counter",
    )
    assert set(metric["tags"]) == {"action", "component", "decision", "reason"}
    labels_src = vector["transforms"][counts["inputs"][0]]["source"]
    for field in ("task_id", "source", "destination", "dns", "url", "message"):
        assert field not in labels_src


def _vrl():
    mod = pytest.importorskip("vrl_python", reason="VRL bindings (pip: vrl-python) not installed")
    return mod.VRLRuntime()


def test_vector_parse_keeps_every_ecs_field(vector: dict[str, Any]) -> None:
    vrl = _vrl()
    program = vector["transforms"]["stockade_events"]["source"]
    for ev in _sample_events():
        line = json.dumps(ev, separators=(",", ":"), ensure_ascii=False)
        vector_event = {
            "message": line,
            "file": "/var/log/stockade/events.jsonl",
            "host": "gw1",
            "source_type": "file",
            "timestamp": "2026-01-01T00:00:00Z",
        }
        out = vrl.execute(program, vector_event).processed_event
        host = out.pop("host")
        assert isinstance(host["name"], str) and host["name"]
        assert out == ev, "the event must arrive exactly as written (plus host.name)"


@pytest.mark.parametrize("node", ["node-7", "", None])
def test_vector_host_name_is_the_kubernetes_node_or_the_host(
    vector: dict[str, Any], monkeypatch: pytest.MonkeyPatch, node: str | None
) -> None:
    """NODE_NAME (the downward API's spec.nodeName) first: in a pod the hostname is the
    pod's. Unset or empty: the host's own name."""
    vrl = _vrl()
    if node is None:
        monkeypatch.delenv("NODE_NAME", raising=False)
    else:
        monkeypatch.setenv("NODE_NAME", node)
    program = vector["transforms"]["stockade_events"]["source"]
    ev = _sample_events()[0]
    out = vrl.execute(program, {"message": json.dumps(ev)}).processed_event
    assert out["host"] == {"name": node or socket.gethostname()}


def test_vector_skips_long_lines_and_goes_on(vector: dict[str, Any], tmp_path: Path) -> None:
    (src,) = [s for s in vector["sources"].values() if s["type"] == "file"]
    # Vector skips a line over max_line_bytes and reads on; Stockade's are far smaller
    assert src["max_line_bytes"] >= 2**20
    assert max(_line_sizes(tmp_path)) * 100 < src["max_line_bytes"]


def _line_sizes(tmp_path: Path) -> list[int]:
    path = tmp_path / "sizes.jsonl"
    writer = EventWriter(path)
    for ev in _sample_events():
        writer.write(ev)
    writer.close()
    return [len(line) for line in path.read_bytes().splitlines()]


def test_vector_parse_refuses_non_json_lines(vector: dict[str, Any]) -> None:
    vrl = _vrl()
    program = vector["transforms"]["stockade_events"]["source"]
    with pytest.raises(Exception, match=r"parse_json|object"):
        vrl.execute(program, {"message": "not an event"})
    # drop_on_error + reroute_dropped: the line goes to .dropped, not to the SIEM
    t = vector["transforms"]["stockade_events"]
    assert t["drop_on_error"] and t["reroute_dropped"]


def test_vector_metric_labels_from_events(vector: dict[str, Any]) -> None:
    vrl = _vrl()
    program = vector["transforms"]["stockade_event_labels"]["source"]
    got = [vrl.execute(program, copy.deepcopy(ev)).processed_event for ev in _sample_events()]
    assert got[2] == {
        "action": "bypass_attempt",
        "component": "launcher",
        "decision": "denied",
        "reason": "bypass_attempt",
    }
    assert got[3] == {
        "action": "vault_status",
        "component": "broker",
        "decision": "none",
        "reason": "vault_unavailable",
    }
    for labels in got:
        assert set(labels) == {"action", "component", "decision", "reason"}


# -- Fluent Bit -----------------------------------------------------------------------------
def parse_fluent_bit(path: Path, text: str | None = None) -> list[tuple[str, dict[str, str]]]:
    """Classic-format sections: [(NAME, {key: value})] (keys case-insensitive, lowered)."""
    sections: list[tuple[str, dict[str, str]]] = []
    for lineno, raw in enumerate((path.read_text() if text is None else text).splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"\[([A-Z_]+)\]", line)
        if m:
            sections.append((m.group(1), {}))
            continue
        assert sections and raw.startswith((" ", "\t")), f"{path}:{lineno}: {raw!r}"
        key, _, value = line.partition(" ")
        assert value.strip(), f"{path}:{lineno}: key without value"
        assert key.lower() not in sections[-1][1], f"{path}:{lineno}: duplicate {key}"
        sections[-1][1][key.lower()] = value.strip()
    return sections


def test_fluent_bit_config_structure() -> None:
    sections = parse_fluent_bit(FLUENT_BIT)
    names = [n for n, _ in sections]
    assert names.count("SERVICE") == 1 and "INPUT" in names and "OUTPUT" in names
    assert set(names) <= {"SERVICE", "INPUT", "FILTER", "OUTPUT"}
    tags = {s["tag"] for n, s in sections if n == "INPUT"}
    for n, s in sections:
        if n in ("FILTER", "OUTPUT"):
            assert any(fnmatch.fnmatch(t, s["match"]) for t in tags), s


def _size(text: str) -> int:
    """Fluent Bit's sizes: 64K, 2M, or bytes."""
    m = re.fullmatch(r"(\d+)([KMG]?)", text.upper())
    assert m, text
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]


def _fluent_bit_filters(sections: list[tuple[str, dict[str, str]]]) -> list[dict[str, str]]:
    return [s for n, s in sections if n == "FILTER"]


def _apply_host_filters(filters: list[dict[str, str]], record: dict[str, Any],
                        hostname: str, env: dict[str, str]) -> dict[str, Any]:
    """What the sysinfo, modify (Set) and nest filters do to a record, in config order."""
    out = dict(record)
    for f in filters:
        if f["name"] == "sysinfo":
            out[f["hostname_key"]] = hostname
        elif f["name"] == "modify":
            key, _, value = f["set"].partition(" ")
            out[key] = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], value.strip())
        elif f["name"] == "nest":
            assert f["operation"] == "nest"
            moved = {k: out.pop(k) for k in list(out) if fnmatch.fnmatch(k, f["wildcard"])}
            prefix = f.get("remove_prefix", "")
            out[f["nest_under"]] = {k.removeprefix(prefix): v for k, v in moved.items()}
    return out


def test_fluent_bit_adds_host_name_like_vector() -> None:
    """sysinfo, then nest: each event leaves with host.name (ECS) and nothing else added,
    the record Vector ships."""
    filters = _fluent_bit_filters(parse_fluent_bit(FLUENT_BIT))
    assert [f["name"] for f in filters] == ["sysinfo", "nest"]
    assert filters[0]["hostname_key"] == filters[1]["wildcard"] == "host_name"
    for ev in _sample_events():
        assert "host" not in ev, "the nest would overwrite an event's own host object"
        out = _apply_host_filters(filters, ev, "gw1", {})
        assert out == {**ev, "host": {"name": "gw1"}}


def test_fluent_bit_kubernetes_node_name_filter_sits_before_the_nest() -> None:
    """The commented modify filter, once uncommented, overwrites host_name with the node
    name between sysinfo and nest."""
    text = FLUENT_BIT.read_text()
    block = re.search(r"^# \[FILTER\]\n(?:#     .*\n)+", text, re.M)
    assert block, "the commented Kubernetes filter is missing"
    uncommented = re.sub(r"^# ", "", block.group(0), flags=re.M)
    k8s = text.replace(block.group(0), uncommented)
    filters = _fluent_bit_filters(parse_fluent_bit(FLUENT_BIT, k8s))
    assert [f["name"] for f in filters] == ["sysinfo", "modify", "nest"]
    assert filters[1]["match"] == "stockade.events"
    out = _apply_host_filters(filters, _sample_events()[0], "pod-abc", {"NODE_NAME": "node-7"})
    assert out["host"] == {"name": "node-7"}


def test_fluent_bit_skips_long_lines_instead_of_stopping(tmp_path: Path) -> None:
    (tail,) = [s for n, s in parse_fluent_bit(FLUENT_BIT) if n == "INPUT"]
    assert tail["skip_long_lines"].lower() == "on", "Off stops the file at a long line"
    assert _size(tail["buffer_max_size"]) == 2 * 2**20
    assert max(_line_sizes(tmp_path)) < _size(tail["buffer_chunk_size"])


def test_fluent_bit_tails_the_events_file_and_its_rotations(
    events_file: Path, tmp_path: Path
) -> None:
    (tail,) = [s for n, s in parse_fluent_bit(FLUENT_BIT) if n == "INPUT"]
    assert tail["name"] == "tail"
    assert Path(tail["path"]).parent == events_file.parent
    shipped = _shipped_names(tmp_path, tail["path"])
    assert {"events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3"} <= shipped
    assert tail["db"], "offsets must survive restarts"
    assert tail["read_from_head"].lower() == "true"


def test_fluent_bit_parser_keeps_the_event_and_its_timestamp(tmp_path: Path) -> None:
    sections = parse_fluent_bit(FLUENT_BIT)
    (service,) = [s for n, s in sections if n == "SERVICE"]
    (tail,) = [s for n, s in sections if n == "INPUT"]
    parsers = FLUENT_BIT.parent / service["parsers_file"]
    by_name = {s["name"]: s for n, s in parse_fluent_bit(parsers) if n == "PARSER"}
    parser = by_name[tail["parser"]]
    assert parser["format"] == "json"
    assert parser["time_key"] == "@timestamp"
    assert parser["time_keep"].lower() == "on", "@timestamp must stay in the record"
    # %L is Fluent Bit's fractional seconds; Python's %f reads the same six digits
    fmt = parser["time_format"].replace("%L", "%f")
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path)
    for ev in _sample_events():
        writer.write(ev)
    writer.close()
    for ev in read_events(path):
        datetime.strptime(ev["@timestamp"], fmt)


def test_fluent_bit_output_ships_records_unchanged() -> None:
    for n, s in parse_fluent_bit(FLUENT_BIT):
        if n == "OUTPUT" and s["name"] == "http":
            assert s["format"] == "json_lines"
            assert s["json_date_key"] == "false", "no extra date field beside @timestamp"
            assert s["tls"].lower() == "on" and s["tls.verify"].lower() == "on"

"""Helpers for the deploy/ tests: unit-file parsing, metric definitions found in the source,
PromQL selector extraction, and the optional external checkers (promtool, systemd-analyze)."""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
EXAMPLE_CONFIG = DEPLOY / "stockade.yaml"
UNITS = {
    "gateway": DEPLOY / "systemd" / "stockade-gateway.service",
    "broker": DEPLOY / "systemd" / "stockade-broker.service",
}
RULES_FILE = DEPLOY / "prometheus" / "stockade-rules.yaml"
RULES_TEST_FILE = DEPLOY / "prometheus" / "stockade-rules.test.yaml"
RUNBOOKS = REPO / "docs" / "runbooks.md"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yaml"
DASHBOARD = DEPLOY / "grafana" / "stockade-dashboard.json"
VECTOR = DEPLOY / "logging" / "vector.toml"
FLUENT_BIT = DEPLOY / "logging" / "fluent-bit.conf"

# the component folders whose Python source defines metrics
SOURCE_DIRS = ("gateway", "broker", "launcher", "policy", "stockade")
# labels Prometheus adds to every scraped series
TARGET_LABELS = frozenset({"job", "instance"})
# series Prometheus makes itself
BUILTIN_SERIES = {"up": frozenset()}


# -- systemd unit files --------------------------------------------------------------------
def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections -> [(key, value)] in order (systemd keys repeat; values are not merged)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        if current is None or "=" not in line:
            raise ValueError(f"{path}:{lineno}: not a key=value line in a section: {raw!r}")
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def unit_value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str | None:
    """The effective value of a single-valued key (the last assignment wins)."""
    values = unit_values(unit, section, key)
    return values[-1] if values else None


# -- metrics defined in the code -----------------------------------------------------------
@dataclass(frozen=True)
class MetricDef:
    name: str  # as passed to the prometheus_client constructor (family name)
    kind: str  # counter, gauge, histogram, summary
    labels: frozenset[str]
    where: str  # file:line

    def samples(self) -> dict[str, frozenset[str]]:
        """Series names this family exposes -> their label names."""
        if self.kind == "counter":
            return {f"{self.name}_total": self.labels, f"{self.name}_created": self.labels}
        if self.kind == "histogram":
            return {
                f"{self.name}_bucket": self.labels | {"le"},
                f"{self.name}_count": self.labels,
                f"{self.name}_sum": self.labels,
                f"{self.name}_created": self.labels,
            }
        if self.kind == "summary":
            return {
                self.name: self.labels | {"quantile"},
                f"{self.name}_count": self.labels,
                f"{self.name}_sum": self.labels,
                f"{self.name}_created": self.labels,
            }
        return {self.name: self.labels}


_KINDS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
          # the families a custom collector yields at scrape time (gateway/metrics.py)
          "CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge",
          "HistogramMetricFamily": "histogram"}


def _str_list(node: ast.AST | None) -> frozenset[str]:
    if isinstance(node, ast.List | ast.Tuple):
        return frozenset(
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        )
    return frozenset()


@functools.cache
def source_metrics() -> dict[str, MetricDef]:
    """Every prometheus_client metric constructed in the component source, found by reading
    the code (ast): Counter/Gauge/Histogram/Summary("stockade_...", help, labels), and a
    collector's Counter/Gauge/HistogramMetricFamily("stockade_...", help, labels=...)."""
    found: dict[str, MetricDef] = {}
    for folder in SOURCE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                first = node.args[0]
                if (
                    fname not in _KINDS
                    or not isinstance(first, ast.Constant)
                    or not isinstance(first.value, str)
                    or not first.value.startswith("stockade_")
                ):
                    continue
                labels = _str_list(node.args[2] if len(node.args) > 2 else None)
                for kw in node.keywords:
                    if kw.arg in ("labelnames", "labels"):
                        labels = _str_list(kw.value)
                rel = path.relative_to(REPO)
                found[first.value] = MetricDef(
                    first.value, _KINDS[fname], labels, f"{rel}:{node.lineno}"
                )
    return found


@functools.cache
def vector_metrics() -> dict[str, MetricDef]:
    """Metrics Vector's log_to_metric transforms make from the event stream (exposed as
    namespace_name, without a suffix, by its prometheus_exporter sink)."""
    cfg = tomllib.loads(VECTOR.read_text())
    found: dict[str, MetricDef] = {}
    for tname, t in cfg.get("transforms", {}).items():
        if t.get("type") != "log_to_metric":
            continue
        for m in t.get("metrics", []):
            name = f"{m['namespace']}_{m['name']}" if m.get("namespace") else m["name"]
            found[name] = MetricDef(
                name, "vector_" + m["type"], frozenset(m.get("tags", {})), f"vector.toml:{tname}"
            )
    return found


@functools.cache
def known_series() -> dict[str, frozenset[str]]:
    """Series name -> label names (without job/instance) for everything the rules and the
    dashboard may query."""
    out: dict[str, frozenset[str]] = dict(BUILTIN_SERIES)
    for m in source_metrics().values():
        out.update(m.samples())
    for m in vector_metrics().values():
        out[m.name] = m.labels
    return out


# -- PromQL --------------------------------------------------------------------------------
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: tuple[tuple[str, str, str], ...]  # (label, op, value)


def _is_metric_token(tok: str) -> bool:
    return tok.startswith(("stockade_", "stockade:")) or tok in BUILTIN_SERIES


def selectors(expr: str) -> list[Selector]:
    """Metric selectors in a PromQL expression (string literals are skipped)."""
    out: list[Selector] = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in "\"'`":
            j = i + 1
            while j < n and expr[j] != c:
                j += 2 if expr[j] == "\\" else 1
            i = j + 1
            continue
        m = _IDENT.match(expr, i)
        if not m or (i > 0 and (expr[i - 1].isalnum() or expr[i - 1] in "_:$")):
            i += 1
            continue
        tok = m.group(0)
        i = m.end()
        if not _is_metric_token(tok):
            continue
        j = i
        while j < n and expr[j] == " ":
            j += 1
        labels: list[tuple[str, str, str]] = []
        if j < n and expr[j] == "{":
            close = j + 1
            while True:
                mm = _MATCHER.match(expr, close)
                if not mm:
                    break
                labels.append((mm.group(1), mm.group(2), mm.group(3)))
                close = mm.end()
            if close >= n or expr[close] != "}":
                raise ValueError(f"cannot parse the matchers of {tok} in {expr!r}")
            i = close + 1
        out.append(Selector(tok, tuple(labels)))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Label names in by (...) / without (...) clauses."""
    out: set[str] = set()
    for m in _GROUPING.finditer(expr):
        out.update(x.strip() for x in m.group(1).split(",") if x.strip())
    return out


# -- rule and dashboard expressions --------------------------------------------------------
@functools.cache
def load_rules() -> dict:
    return yaml.safe_load(RULES_FILE.read_text())


def rule_exprs() -> list[tuple[str, str]]:
    """(rule name, expr) for every recording and alerting rule."""
    out = []
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            out.append((rule.get("record") or rule["alert"], rule["expr"]))
    return out


def recorded_names() -> set[str]:
    return {r["record"] for g in load_rules()["groups"] for r in g["rules"] if "record" in r}


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query variable of the dashboard."""
    import json

    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"panel {p['id']} {p.get('title')!r}", t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_]+)\)", q)
            out.append((f"variable {var['name']}", inner.group(1) if inner else q))
    return out


GRAFANA_SUBST = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
}


def grafana_to_promql(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana's macros and the dashboard's variables so promtool can parse it."""
    for k, v in GRAFANA_SUBST.items():
        expr = expr.replace(k, v)
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return expr


# -- external checkers ---------------------------------------------------------------------
def tool(name: str, env: str) -> str | None:
    """An external checker: $ENV if set, else from PATH."""
    path = os.environ.get(env)
    if path:
        return path if os.access(path, os.X_OK) else None
    return shutil.which(name)


# -- seccomp filters -----------------------------------------------------------------------
def syscall_group(analyze: str, name: str) -> set[str]:
    """A syscall or @group, expanded with `systemd-analyze syscall-filter`."""
    if not name.startswith("@"):
        return {name}
    import subprocess

    out = subprocess.run(
        [analyze, "syscall-filter", name], capture_output=True, text=True, check=True
    ).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        entry = line.strip()
        if entry and not entry.startswith("#"):
            names |= syscall_group(analyze, entry)
    return names


def unit_syscall_allowlist(unit: dict[str, list[tuple[str, str]]], analyze: str) -> set[str]:
    """The allow list SystemCallFilter= lines build (systemd.exec(5): the first line's kind
    decides; later plain lines add to an allow list, later ~ lines remove)."""
    lines = unit_values(unit, "Service", "SystemCallFilter")
    assert lines and not lines[0].startswith("~"), "expected an allow list first"
    allowed: set[str] = set()
    for value in lines:
        deny = value.startswith("~")
        names: set[str] = set()
        for item in value.lstrip("~").split():
            names |= syscall_group(analyze, item)
        allowed = allowed - names if deny else allowed | names
    return allowed


def traced_syscalls(trace: Path, exec_marker: str) -> set[str]:
    """Syscall names in an `strace -f -o` file from the execve of `exec_marker` on (what
    setpriv did before it is not the service's)."""
    used: set[str] = set()
    started = False
    for line in trace.read_text(errors="replace").splitlines():
        if not started:
            started = "execve(" in line and exec_marker in line.split(",")[0]
            continue
        m = re.match(r"\d+\s+(?:<\.\.\. )?([a-z0-9_]+)[( ]", line)
        if m and m.group(1) not in ("exit", "killed"):
            used.add(m.group(1))
    return used

"""Fuzz the loader: any YAML a person could write either loads or raises RulesError with
positioned problems; it never crashes with anything else."""

from __future__ import annotations

import string
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stockade.policy import RulesError, load_rules

KEYS = [
    "profile", "description", "isolation", "limits", "egress", "allow", "deny", "host", "cidr",
    "ports", "reason", "id", "expires", "http", "methods", "paths", "presets", "mode",
    "broker", "apis", "operations", "rate", "exports", "cpus", "memory", "x", "preset", "api",
    "base_url", "credential", "inject", "style", "tests", "target", "expect",
    "host_must_match_sni", "accept_fronting", "catalogue", "frontends", "provider", "source",
    "checked", "hosts", "cidrs", "note",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(alphabet=string.printable + "ü*@[]", max_size=20),
    st.sampled_from(
        ["enforce", "report", "microvm", "GET", "/a/*", "10/s", "1GiB", "5m", "*.a.test",
         "a.test", "10.0.0.0/8", "2027-01-31", "https://a.test", "bearer", "fastly"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)
    ),
    max_leaves=25,
)
NO_FIXTURE_CHECK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def check(root: Path) -> None:
    try:
        load_rules(root)
    except RulesError as e:
        assert e.problems
        for p in e.problems:
            assert p.line >= 1 and p.column >= 1 and p.file.endswith(".yaml")


@settings(max_examples=150, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=6), st.sampled_from(
    ["profiles", "presets", "apis", "tests", "catalogues"]))  # fmt: skip
def test_structured_fuzz(tmp_path, data, kind):
    root = tmp_path / "fuzz"
    (root / kind).mkdir(parents=True, exist_ok=True)
    (root / kind / "f.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    check(root)


@settings(max_examples=150, deadline=None, suppress_health_check=NO_FIXTURE_CHECK)
@given(st.text(alphabet=string.printable + "ü\u00a0\ufeff", max_size=200))
def test_text_fuzz(tmp_path, text):
    root = tmp_path / "fuzz"
    (root / "profiles").mkdir(parents=True, exist_ok=True)
    (root / "profiles" / "f.yaml").write_text("profile: p\n" + text)
    check(root)


def test_bad_scalar_values_are_positioned(write_rules):
    for text in ("profile: p\negress:\n  allow:\n    - {host: a.test, reason: r, "
                 "expires: 2020-13-45}\n",  # a YAML timestamp that is no date
                 "profile: p\ndescription: !!binary ~~~\n",
                 "profile: p\ndescription: !!python/object:os.system x\n"):  # fmt: skip
        root = write_rules(profiles={"p": text})
        try:
            load_rules(root)
        except RulesError as e:
            assert all(p.line >= 2 for p in e.problems), e.problems
        else:
            raise AssertionError("loaded an invalid file")

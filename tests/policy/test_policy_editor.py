"""The editor's and the pipeline's tools: `rules schema` (every shipped rule file
validates against it), `rules fmt` (canonical order, comments kept, --check), the
'did you mean' hints, `rules diff --exit-code`."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml
from stockade.policy.jsonschema_doc import rule_file_schema
from stockade.policy.schemawalk import KIND_MODELS

from stockade.cli import main

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "rules"
# every rule directory the repository ships (the demo's own rules too)
RULE_DIRS = (SHIPPED, REPO / "stockade" / "stack" / "demo_rules")


def _shipped_files() -> list[Path]:
    return sorted(f for d in RULE_DIRS for k in KIND_MODELS for f in (d / k).glob("*.yaml"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rules", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _as_json(path: Path) -> object:
    # what an editor's YAML server validates: the YAML read as JSON (dates as text)
    return json.loads(json.dumps(yaml.safe_load(path.read_text()), default=str))


def test_shipped_files_exist():
    kinds = {f.parent.name for f in _shipped_files()}
    assert kinds == set(KIND_MODELS), kinds


@pytest.mark.parametrize("path", _shipped_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_rule_file_validates_against_the_schema(path):
    doc = _as_json(path)
    jsonschema.Draft202012Validator(rule_file_schema(path.parent.name)).validate(doc)
    jsonschema.Draft202012Validator(rule_file_schema()).validate(doc)  # the any-kind schema


def test_schema_refuses_what_the_loader_refuses():
    schema = rule_file_schema("profiles")
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    ok = {"profile": "p", "limits": {"memory": "1GiB", "ttl": 60}, "broker": {"apis": {
        "gh": {"operations": [{"method": "GET", "path": "/x"}], "rate": "5/s"}}}}
    assert not list(v.iter_errors(ok))
    bad = {"profile": "p", "egress": {"allow": [{"host": "a.test", "reasn": "typo"}]}}
    messages = sorted(e.message for e in v.iter_errors(bad))
    assert any("'reason' is a required property" in m for m in messages), messages
    assert any("'reasn' was unexpected" in m for m in messages), messages
    assert list(v.iter_errors({"profile": "Bad Name"}))


def test_schema_command_writes_the_file(capsys, tmp_path):
    rc, out, _ = run(capsys, "schema")
    assert rc == 0 and json.loads(out) == rule_file_schema()
    target = tmp_path / "schema.json"
    rc, out, _ = run(capsys, "schema", "--kind", "presets", "-o", str(target))
    assert (rc, out) == (0, "")
    assert json.loads(target.read_text()) == rule_file_schema("presets")
    rc, _, err = run(capsys, "schema", "-o", str(tmp_path / "missing" / "s.json"))
    assert rc == 2 and "cannot write" in err


MESSY = """\
# the build profile
egress:
  allow:
    # the index, read-only
    - reason: the index   # why
      http: {paths: ["/simple/**"], methods: [GET]}
      host: pypi.org
  mode: enforce
description: builds
profile: p   # its name
limits: {ttl: 10s, cpus: 1}
"""

CANONICAL = """\
# the build profile
profile: p   # its name
description: builds
limits: {cpus: 1, ttl: 10s}
egress:
  mode: enforce
  allow:
    # the index, read-only
    - host: pypi.org
      reason: the index   # why
      http: {methods: [GET], paths: ["/simple/**"]}
"""


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    root = tmp_path / "rules"
    (root / "profiles").mkdir(parents=True)
    (root / "profiles" / "p.yaml").write_text(MESSY)
    return root


def test_fmt_check_reports_then_fmt_rewrites(capsys, messy):
    target = messy / "profiles" / "p.yaml"
    rc, out, err = run(capsys, "fmt", "--check", "--diff", str(messy))
    assert rc == 1 and f"{target}: not canonical" in out and "+profile: p   # its name" in out
    assert "1 file(s) would be reformatted, 0 failed" in err
    assert target.read_text() == MESSY  # --check writes nothing
    rc, out, _ = run(capsys, "fmt", str(messy))
    assert (rc, out) == (0, f"{target}: reformatted\n")
    assert target.read_text() == CANONICAL
    rc, out, _ = run(capsys, "fmt", "--check", str(target))  # one file, now canonical
    assert (rc, out) == (0, "")


def test_fmt_refuses_bad_files_and_keeps_them(capsys, messy):
    broken = messy / "profiles" / "q.yaml"
    broken.write_text("profile: q\negress: {allow: [\n")
    dup = messy / "profiles" / "r.yaml"
    dup.write_text("profile: r\nprofile: s\n")
    stray = messy / "notes.yaml"
    stray.write_text("a: 1\n")
    rc, _, err = run(capsys, "fmt", str(messy), str(stray))
    assert rc == 2
    assert f"{broken}:3:1: invalid YAML" in err
    assert f"{dup}:2:1: invalid YAML" in err and "duplicate" in err
    assert f"{stray}:1:1: not a rule file" in err
    assert broken.read_text() == "profile: q\negress: {allow: [\n"
    assert dup.read_text() == "profile: r\nprofile: s\n"
    # the good file of the same directory was still formatted
    assert (messy / "profiles" / "p.yaml").read_text() == CANONICAL
    rc, _, err = run(capsys, "fmt", str(messy / "profiles" / "none.yaml"))
    assert rc == 2 and "cannot read" in err


def test_shipped_rule_files_are_canonical(capsys):
    rc, out, err = run(capsys, "fmt", "--check", "--diff", *map(str, RULE_DIRS))
    assert rc == 0, out + err


def _write(root: Path, kind: str, name: str, text: str) -> None:
    (root / kind).mkdir(parents=True, exist_ok=True)
    (root / kind / f"{name}.yaml").write_text(textwrap.dedent(text))


def test_lint_says_did_you_mean(capsys, tmp_path):
    root = tmp_path / "rules"
    _write(root, "presets", "pypi-readonly", """\
        preset: pypi-readonly
        allow:
          - {host: pypi.org, reason: index, expirs: 2030-01-01}
        """)
    _write(root, "apis", "github", """\
        api: github
        base_url: https://api.github.com
        credential: {mount: kv, path: gh, field: token}
        inject: {style: bearer}
        """)
    _write(root, "profiles", "build", """\
        profile: build
        egress:
          presets: [pypi-readonli]
          alow: []
        broker:
          apis:
            githb: {operations: [{method: GET, path: /x}]}
            github: {operations: [{method: GET, path: /x}], burts: 3}
        """)
    _write(root, "tests", "t", """\
        tests:
          - {profile: buld, target: "https://pypi.org/", expect: allow}
        """)
    rc, out, _ = run(capsys, "lint", str(root))
    assert rc == 1
    lines = out.splitlines()
    expected = [
        "profiles/build.yaml:4:3: egress.alow: unknown key; did you mean 'allow'?",
        "profiles/build.yaml:8:53: broker.apis.github.burts: unknown key; did you mean "
        "'burst'?",
        "presets/pypi-readonly.yaml:3:37: allow[0].expirs: unknown key; did you mean "
        "'expires'?",
        # the profile is invalid, so not known: nothing to suggest
        "tests/t.yaml:2:15: tests[0].profile: unknown profile 'buld'",
    ]
    for want in expected:
        assert any(line.endswith(want) for line in lines), (want, lines)


def test_lint_suggests_presets_and_apis(capsys, write_rules):
    root = write_rules(
        presets={"pypi-readonly": "preset: pypi-readonly\n"},
        apis={"github": """\
            api: github
            base_url: https://api.github.com
            credential: {mount: kv, path: gh, field: token}
            inject: {style: bearer}
            """},
        profiles={"p": """\
            profile: p
            egress: {presets: [pypi-readonli]}
            broker: {apis: {githb: {operations: [{method: GET, path: /x}]}}}
            """, "build": "profile: build\n"},
        tests={"t": """\
            tests:
              - {profile: buld, target: "https://pypi.org/", expect: deny}
              - {profile: build, target: "https://pypi.org/", expect: deny, rule: pypi-idx}
            """},
    )
    rc, out, _ = run(capsys, "lint", str(root))
    assert rc == 1
    assert ("egress.presets[0]: unknown preset 'pypi-readonli'; did you mean "
            "'pypi-readonly'? (known: pypi-readonly)") in out  # fmt: skip
    assert "broker.apis.githb: unknown API 'githb'; did you mean 'github'? (known: github)" in out
    assert "tests[0].profile: unknown profile 'buld'; did you mean 'build'?" in out


def test_diff_exit_code(capsys, tmp_path):
    same = tmp_path / "same"
    shutil.copytree(SHIPPED, same)
    rc, out, _ = run(capsys, "diff", "--exit-code", str(SHIPPED), str(same))
    assert rc == 0 and "no effective change in any profile" in out
    wider = tmp_path / "wider"
    shutil.copytree(SHIPPED, wider)
    profile = wider / "profiles" / "no-network.yaml"
    profile.write_text(profile.read_text().replace(
        "  presets: [doh-deny]\n",
        "  presets: [doh-deny]\n  allow:\n    - {host: example.org, reason: x}\n"))
    rc, out, err = run(capsys, "diff", str(SHIPPED), str(wider))
    assert rc == 0, err  # without --exit-code a change is no failure
    rc, out, _ = run(capsys, "diff", "--exit-code", "--json", str(SHIPPED), str(wider))
    assert rc == 1 and json.loads(out)["profiles"][0]["profile"] == "no-network"


def test_the_shipped_schema_file_is_current():
    # editors point at rules/schema.json (docs/rules.md); regenerate it with
    # `stockade rules schema -o rules/schema.json` after a change of policy/schema.py
    assert json.loads((SHIPPED / "schema.json").read_text()) == rule_file_schema()


def test_fmt_never_writes_a_change_of_meaning():
    from stockade.policy.fmt import FmtError, _same_meaning

    _same_meaning("a: [1, 2]  # c\n", "a:\n  - 1\n  - 2\n")  # same data, other layout
    with pytest.raises(FmtError, match="would change what the file means"):
        _same_meaning("a: yes\n", "a: 'yes'\n")  # YAML 1.1 reads the first as true


def test_fmt_on_a_kind_folder_and_a_yml_file(capsys, tmp_path):
    presets = tmp_path / "rules" / "presets"
    presets.mkdir(parents=True)
    (presets / "p.yml").write_text("allow: []\npreset: p\n")
    rc, out, _ = run(capsys, "fmt", str(presets))
    assert (rc, out) == (0, f"{presets / 'p.yml'}: reformatted\n")
    assert (presets / "p.yml").read_text() == "preset: p\nallow: []\n"

"""Shared front-ends: `host_must_match_sni` (inspected only to hold Host to the SNI), the
`accept_fronting` opt-out, the catalogue in rules/catalogues/ and the lint over both."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from stockade.policy import RequestFacts, RulesError, decide, load_rules
from stockade.policy.diff import diff_rulesets
from stockade.policy.lint import lint_ruleset, shared_frontend

from stockade.cli import main

SHIPPED = Path(__file__).resolve().parents[2] / "rules"
TODAY = date(2026, 12, 1)

CATALOGUE = """\
catalogue: cdn
frontends:
  - provider: fastly
    source: https://api.fastly.com/public-ip-list
    checked: 2026-11-30
    cidrs: [151.101.0.0/16, "2a04:4e42::/32"]
  - provider: fastly
    source: https://pypi.org/sponsors/
    checked: 2026-11-30
    hosts: ["*.fastly.net", files.example.test, "*.map.fastly.net"]
"""


def profile(*entries: str) -> str:
    body = "".join(f"    - {e}\n" for e in entries)
    return f"profile: p\negress:\n  allow:\n{body}"


def load(write_rules, *entries: str, catalogue: str = CATALOGUE):
    return load_rules(write_rules(profiles={"p": profile(*entries)},
                                  catalogues={"cdn": catalogue}))  # fmt: skip


def lint(rs, strict: bool = False) -> list:
    return lint_ruleset(rs, TODAY, expiring_within=0, strict=strict)


# -- the rule field ----------------------------------------------------------------------------


def test_host_must_match_sni_needs_the_inspector_and_then_allows_any_method_and_path(
    write_rules,
):
    rs = load(write_rules, "{host: files.example.test, id: f, reason: r, "
              "host_must_match_sni: true}")  # fmt: skip
    bare = decide(rs, "p", RequestFacts(host="files.example.test", port=443))
    assert not bare.allowed and bare.reason == "inspection_unavailable"
    assert bare.needs_inspection and bare.rule_id == "f"
    for method, path in (("GET", "/a/b.whl"), ("POST", "/upload"), ("DELETE", "/")):
        facts = RequestFacts(host="files.example.test", port=443, method=method, path=path)
        v = decide(rs, "p", facts)
        assert v.allowed and v.reason == "allowed_by_rule" and v.needs_inspection
        assert v.rule_id == "f"


def test_without_the_field_the_entry_stays_uninspected(write_rules):
    rs = load(write_rules, "{host: files.example.test, id: f, reason: r}")
    v = decide(rs, "p", RequestFacts(host="files.example.test", port=443))
    assert v.allowed and not v.needs_inspection


def test_a_wider_uninspected_entry_wins_and_lint_says_the_check_has_no_effect(write_rules):
    narrow = "{host: a.example.test, id: narrow, reason: r, host_must_match_sni: true}"
    rs = load(write_rules, narrow, "{host: '*.example.test', id: wide, reason: r}")
    assert not decide(rs, "p", RequestFacts(host="a.example.test", port=443)).needs_inspection
    msgs = "\n".join(str(p) for p in lint(rs))
    assert "the host_must_match_sni of 'narrow' has no effect" in msgs


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{cidr: 10.0.0.0/8, reason: r, host_must_match_sni: true}",
         "'host_must_match_sni' needs a 'host' entry"),
        ("{host: a.test, reason: r, host_must_match_sni: true, accept_fronting: why}",
         "'accept_fronting' is for uninspected entries"),
        ("{host: a.test, reason: r, http: {methods: [GET]}, accept_fronting: why}",
         "'accept_fronting' is for uninspected entries"),
        ("{host: a.test, reason: r, accept_fronting: '  '}", "reason must say why"),
        ("{host: a.test, reason: r, host_must_match_sni: 'yes'}", "valid boolean"),
    ],
)  # fmt: skip
def test_bad_field_combinations_are_errors_with_their_position(write_rules, entry, message):
    with pytest.raises(RulesError) as e:
        load(write_rules, entry)
    text = str(e.value)
    assert message in text and "profiles/p.yaml:4:" in text


def test_deny_entries_take_neither_field(write_rules):
    deny = "{host: a.test, reason: r, host_must_match_sni: true}"
    root = write_rules(profiles={"p": f"profile: p\negress:\n  deny:\n    - {deny}\n"})
    with pytest.raises(RulesError, match="deny entries take no 'host_must_match_sni'"):
        load_rules(root)


def test_diff_reports_a_dropped_host_check_as_newly_allowed(write_rules, tmp_path):
    old = load(write_rules, "{host: files.example.test, id: f, reason: r, "
               "host_must_match_sni: true}")  # fmt: skip
    new_root = tmp_path / "new"
    (new_root / "profiles").mkdir(parents=True)
    (new_root / "profiles" / "p.yaml").write_text(
        profile("{host: files.example.test, id: f, reason: r}")
    )
    new = load_rules(new_root)
    (d,) = diff_rulesets(old, new, TODAY)
    assert d.newly_allowed == ["files.example.test:443"]
    assert d.no_longer_allowed == []  # the uninspected entry allows all the old one did
    (back,) = diff_rulesets(new, old, TODAY)
    assert back.newly_allowed == [] and back.no_longer_allowed == ["files.example.test:443"]


# -- the catalogue -----------------------------------------------------------------------------


def test_catalogue_loads_with_positions_and_sources(write_rules):
    rs = load(write_rules, "{host: a.test, reason: r}")
    assert [str(f) for f in rs.frontends] == [
        "151.101.0.0/16", "2a04:4e42::/32", "*.fastly.net", "files.example.test",
        "*.map.fastly.net",
    ]  # fmt: skip
    assert all(f.provider == "fastly" and f.checked == date(2026, 11, 30) for f in rs.frontends)
    assert rs.frontends[2].source == "https://pypi.org/sponsors/"
    loc = rs.frontends[3].location
    assert loc is not None and loc.file.endswith("catalogues/cdn.yaml") and loc.line == 10


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ("{provider: x, checked: 2026-01-01, hosts: [a.test]}", "source: required key"),
        ("{provider: x, source: 'http://a.test/', checked: 2026-01-01, hosts: [a.test]}",
         "source must be the https:// URL"),
        ("{provider: x, source: 'https://a.test/', hosts: [a.test]}", "checked: required key"),
        ("{provider: x, source: 'https://a.test/', checked: 2026-01-01}", "needs 'hosts' or"),
        ("{provider: x, source: 'https://a.test/', checked: 2026-01-01, cidrs: [10.0.0.1/8]}",
         "invalid CIDR"),
    ],
)  # fmt: skip
def test_catalogue_problems_refuse_the_rule_set(write_rules, group, message):
    with pytest.raises(RulesError) as e:
        load(write_rules, "{host: a.test, reason: r}",
             catalogue=f"catalogue: cdn\nfrontends:\n  - {group}\n")  # fmt: skip
    assert message in str(e.value) and "catalogues/cdn.yaml:3:" in str(e.value)


def test_shipped_catalogue_covers_the_providers_and_every_entry_has_a_source():
    rs = load_rules(SHIPPED)
    providers = {f.provider for f in rs.frontends}
    assert {"fastly", "cloudflare", "cloudfront", "akamai", "azure-front-door", "google"} <= (
        providers
    )
    for f in rs.frontends:
        u = urlsplit(f.source)
        assert u.scheme == "https" and u.hostname, f
        assert isinstance(f.checked, date) and f.location is not None
    hosts = {f.host for f in rs.frontends if f.host}
    assert {"files.pythonhosted.org", "*.fastly.net", "*.cloudfront.net", "*.azurefd.net",
            "*.googleusercontent.com", "*.akamaized.net", "*.edgekey.net"} <= hosts  # fmt: skip
    cidrs = {f.provider for f in rs.frontends if f.cidr is not None}
    assert {"fastly", "cloudflare", "cloudfront", "google"} <= cidrs


# -- the lint ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "hit"),
    [
        ("{host: files.example.test, id: e, reason: r}", "files.example.test"),
        ("{host: global.ssl.fastly.net, id: e, reason: r}", "*.fastly.net"),
        ("{host: '*.example.test', id: e, reason: r}", "files.example.test"),  # covers it
        ("{cidr: 151.101.64.0/24, id: e, reason: r}", "151.101.0.0/16"),
        ("{cidr: 151.0.0.0/8, id: e, reason: r}", "151.101.0.0/16"),
        ("{cidr: '2a04:4e42:1::/48', id: e, reason: r}", "2a04:4e42::/32"),
    ],
)
def test_uninspected_entry_on_a_shared_frontend_warns_and_is_an_error_when_strict(
    write_rules, entry, hit
):
    rs = load(write_rules, entry)
    (w,) = [p for p in lint(rs) if "shared front-end" in p.message]
    assert w.severity == "warning" and w.file.endswith("profiles/p.yaml") and w.line == 4
    assert f"entry 'e' reaches the shared front-end {hit} (fastly, https://" in w.message
    assert "domain fronting" in w.message and "accept_fronting" in w.message
    fix = "host_must_match_sni: true' (or an 'http' block)" if "host" in entry else "allow its"
    assert fix in w.message
    (e,) = [p for p in lint(rs, strict=True) if "shared front-end" in p.message]
    assert e.severity == "error" and e.message == w.message


@pytest.mark.parametrize(
    "entry",
    [
        "{host: files.example.test, id: e, reason: r, host_must_match_sni: true}",
        "{host: files.example.test, id: e, reason: r, http: {methods: [GET]}}",
        "{host: elsewhere.test, id: e, reason: r}",
        "{cidr: 151.102.0.0/16, id: e, reason: r}",
        "{cidr: '2a04:4e40::/32', id: e, reason: r}",
    ],
)
def test_inspected_or_unrelated_entries_are_clean(write_rules, entry):
    assert lint(load(write_rules, entry), strict=True) == []


def test_accept_fronting_is_shown_as_a_note_and_never_fails(write_rules):
    rs = load(write_rules, "{host: files.example.test, id: e, reason: r, "
              "accept_fronting: public wheels only; throughput matters more here}")  # fmt: skip
    (n,) = lint(rs, strict=True)
    assert n.severity == "note"
    assert "uninspected by choice (accept_fronting: public wheels only" in n.message
    assert str(n).split(": ", 2)[1] == "note"


def test_preset_entries_are_linted_once_where_they_are_written(write_rules):
    root = write_rules(
        presets={"cdn": "preset: cdn\nallow:\n  - {host: x.fastly.net, id: e, reason: r}\n"},
        profiles={"p": "profile: p\negress:\n  presets: [cdn]\n",
                  "q": "profile: q\negress:\n  presets: [cdn]\n"},
        catalogues={"cdn": CATALOGUE},
    )  # fmt: skip
    found = [p for p in lint(load_rules(root)) if "shared front-end" in p.message]
    assert len(found) == 1 and found[0].file.endswith("presets/cdn.yaml")


def test_expired_entries_are_not_linted_for_fronting(write_rules):
    rs = load(write_rules, "{host: files.example.test, id: e, reason: r, expires: 2020-01-01}")
    assert not [p for p in lint(rs) if "shared front-end" in p.message]


def test_shared_frontend_matching_is_exact_about_suffixes(write_rules):
    rs = load(write_rules, "{host: a.test, reason: r}")
    entries = {e.host: e for e in rs.profiles["p"].allow}
    assert shared_frontend(entries["a.test"], rs.frontends) is None


# -- the CLI -----------------------------------------------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rules", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_warns_and_fails_only_with_strict(capsys, write_rules):
    root = write_rules(profiles={"p": profile("{host: files.example.test, id: e, reason: r}")},
                       catalogues={"cdn": CATALOGUE})  # fmt: skip
    rc, out, err = run(capsys, "lint", str(root))
    assert rc == 0 and "warning: entry 'e' reaches the shared front-end" in out
    assert "0 error(s), 1 warning(s)" in err
    rc, out, err = run(capsys, "lint", "--strict", str(root))
    assert rc == 1 and "warning:" not in out and ": entry 'e' reaches the shared" in out
    assert "1 error(s), 0 warning(s)" in err
    rc, out, _ = run(capsys, "lint", "--strict", "--json", str(root))
    assert rc == 1 and '"severity": "error"' in out and '"notes": 0' in out


def test_cli_shows_the_opt_out(capsys, write_rules):
    root = write_rules(
        profiles={"p": profile("{host: files.example.test, id: e, reason: r, "
                               "accept_fronting: bulk downloads}")},
        catalogues={"cdn": CATALOGUE},
    )  # fmt: skip
    rc, out, err = run(capsys, "lint", "--strict", str(root))
    assert rc == 0 and "note: entry 'e' reaches" in out and "accept_fronting: bulk" in out
    assert "0 error(s), 0 warning(s), 1 note(s)" in err


def test_shipped_rules_make_the_choice_for_every_shared_frontend_entry(capsys):
    rc, out, err = run(capsys, "lint", "--strict", str(SHIPPED))
    assert rc == 0 and "0 error(s), 0 warning(s)" in err, out
    rs = load_rules(SHIPPED)
    on_frontend = [
        e for p in rs.profiles.values() for e in p.allow if shared_frontend(e, rs.frontends)
    ]
    assert {e.id for e in on_frontend} >= {"pypi-files", "pypi-index", "github-objects"}
    for e in on_frontend:
        assert e.inspected or e.accept_fronting, e.id
    files = rs.profiles["pypi-build"].allow
    assert next(e for e in files if e.id == "pypi-files").host_must_match_sni


def test_strict_refuses_a_rules_directory_without_a_catalogue(capsys, write_rules):
    """Without `catalogues/` there is nothing to check entries against: --strict must not
    pass by checking nothing (a plain lint still passes, as before)."""
    root = write_rules(profiles={"p": profile("{host: files.example.test, id: e, reason: r}")})
    rc, out, err = run(capsys, "lint", str(root))
    assert rc == 0 and "0 error(s), 0 warning(s)" in err, out
    rc, out, err = run(capsys, "lint", "--strict", str(root))
    assert rc == 1 and "1 error(s)" in err, out
    assert f"{root}/catalogues:1:1: catalogues: no shared front-end catalogue" in out

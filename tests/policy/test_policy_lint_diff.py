"""Lint warnings and the semantic diff."""

from __future__ import annotations

from datetime import date

from stockade.policy import load_rules
from stockade.policy.diff import diff_rulesets
from stockade.policy.lint import lint_ruleset, pattern_covers

PROFILE = """
profile: p
egress:
  presets: [used]
  allow:
    - {host: old.test, reason: r, expires: 2026-01-01}
    - {host: fine.test, reason: r, expires: 2099-01-01}
    - {host: x.bad.test, reason: r}
    - {cidr: 10.1.1.0/24, reason: r}
    - {host: upload.pypi.org, reason: r}
    - {host: "*.github.com", reason: r}
    - {host: registry.npmjs.org, reason: r, http: {methods: [GET]}}
  deny:
    - {host: "*.bad.test", reason: r}
    - {cidr: 10.1.0.0/16, reason: r}
"""
USED = "preset: used\nallow: [{host: u.test, reason: r}]\n"
UNUSED = "preset: unused\nallow: [{host: v.test, reason: r}]\n"


def test_lint_warnings(write_rules):
    rs = load_rules(
        write_rules(profiles={"p": PROFILE}, presets={"used": USED, "unused": UNUSED})
    )
    warnings = lint_ruleset(rs, today=date(2026, 6, 1))
    assert all(w.severity == "warning" for w in warnings)
    text = "\n".join(str(w) for w in warnings)
    assert "p.yaml:5:7: warning: entry 'p:allow:old.test' expired on 2026-01-01" in text
    assert "fine.test" not in text
    assert "'p:allow:x.bad.test' is shadowed by deny 'p:deny:*.bad.test'" in text
    assert "'p:allow:10.1.1.0/24' is shadowed by deny 'p:deny:10.1.0.0/16'" in text
    assert "'p:allow:upload.pypi.org' reaches upload.pypi.org" in text
    # a wildcard over an upload service of the catalogue (one warning per entry)
    assert ("'p:allow:*.github.com' is a wildcard over gist.github.com (gist: github-gist, "
            "https://docs.github.com/") in text  # fmt: skip
    assert "'p:allow:*.github.com' reaches" not in text
    assert "registry.npmjs.org' reaches" not in text  # it has an http block
    assert "unused.yaml:1:1: warning: preset: 'unused' is not used by any profile" in text
    assert "'used'" not in text
    # expiry is relative to the given day
    assert "expired" not in "\n".join(str(w) for w in lint_ruleset(rs, date(2025, 12, 31)))


def test_upload_host_denied_elsewhere_is_not_warned(write_rules):
    text = """
    profile: p
    egress:
      allow: [{host: "*.pypi.org", reason: r}]
      deny: [{host: upload.pypi.org, reason: r}, {host: test.pypi.org, reason: r}]
    """
    rs = load_rules(write_rules(profiles={"p": text}))
    assert lint_ruleset(rs, date(2026, 1, 1)) == []


def test_pattern_covers():
    assert pattern_covers("*.a.test", "x.a.test")
    assert pattern_covers("*.a.test", "*.x.a.test")
    assert pattern_covers("*.a.test", "*.a.test")
    assert not pattern_covers("*.a.test", "a.test")
    assert not pattern_covers("a.test", "*.a.test")
    assert not pattern_covers("*.a.test", "xa.test")


OLD = """
profile: p
egress:
  allow:
    - {host: a.test, reason: r}
    - {host: b.test, reason: r, http: {methods: [GET]}}
    - {host: gone.test, reason: r}
  deny:
    - {host: d.test, reason: r}
"""
NEW = """
profile: p
egress:
  mode: report
  proxy_env: true
  allow:
    - {host: a.test, reason: renamed reason, id: a-new-id}
    - {host: b.test, reason: r}
    - {host: "*.c.test", reason: r, ports: [443, 8443]}
"""


def test_diff_reports_effective_changes(tmp_path, write_rules):
    old_dir = write_rules(profiles={"p": OLD, "q": "profile: q\n"})
    old = load_rules(old_dir)
    old_dir.rename(tmp_path / "old")
    new = load_rules(write_rules(profiles={"p": NEW, "r": "profile: r\n"}))
    diffs = {d.name: d for d in diff_rulesets(old, new, date(2026, 1, 1))}
    p = diffs["p"]
    assert p.status == "changed"
    assert "a.test:443" not in p.newly_allowed  # only the id/reason changed
    assert "b.test:443" in p.newly_allowed  # http block dropped: wider
    assert "*.c.test:443,8443" in p.newly_allowed
    assert p.no_longer_allowed == ["gone.test:443"]
    assert p.denies_removed == ["d.test:any"]
    assert "egress mode: enforce -> report" in p.settings
    assert "egress proxy_env: False -> True" in p.settings
    assert diffs["q"].status == "removed" and diffs["r"].status == "added"


def test_diff_of_identical_rules_is_empty(write_rules):
    rs = load_rules(write_rules(profiles={"p": OLD}))
    assert diff_rulesets(rs, rs) == []


def test_soon_expiring_and_report_mode_warnings(write_rules):
    text = """
    profile: p
    egress:
      mode: report
      allow: [{host: soon.test, reason: r, expires: 2026-06-10}]
    """
    rs = load_rules(write_rules(profiles={"p": text}))
    msgs = "\n".join(str(w) for w in lint_ruleset(rs, date(2026, 6, 1)))
    assert "'p:allow:soon.test' expires on 2026-06-10 (in 9 day(s))" in msgs
    assert "p.yaml:1:1: warning: egress.mode: profile 'p' is in report mode" in msgs
    quiet = "\n".join(str(w) for w in lint_ruleset(rs, date(2026, 6, 1), expiring_within=0))
    assert "expires on" not in quiet
    assert "expires on" not in "\n".join(str(w) for w in lint_ruleset(rs, date(2026, 5, 1)))


def test_http_block_bypassed_by_wider_uninspected_entry(write_rules):
    text = """
    profile: p
    egress:
      presets: [ro]
      allow: [{host: "*.npmjs.org", reason: convenience}]
    """
    ro = "preset: ro\nallow: [{host: registry.npmjs.org, reason: r, http: {methods: [GET]}}]\n"
    rs = load_rules(write_rules(profiles={"p": text}, presets={"ro": ro}))
    msgs = "\n".join(str(w) for w in lint_ruleset(rs, date(2026, 1, 1)))
    assert "ro.yaml:2:9: warning: the http block of 'ro:allow:registry.npmjs.org' has no " \
           "effect in profile 'p': 'p:allow:*.npmjs.org'" in msgs
    assert "'p:allow:*.npmjs.org' is a wildcard over registry.npmjs.org (package-registry" \
           in msgs

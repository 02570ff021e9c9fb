"""The catalogue of upload-capable services (policy/upload_services.yaml) and lint's
warnings over it: a wildcard over one unless inspected read-only, an exact name with
every method."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import pytest
from stockade.policy import load_rules
from stockade.policy.lint import lint_ruleset
from stockade.policy.problems import RulesError
from stockade.policy.uploads import CATALOGUE, read_catalogue, upload_services

TODAY = date(2026, 12, 1)


def test_the_catalogue_is_valid_sourced_and_covers_each_kind():
    services = upload_services()
    assert {u.kind for u in services} >= {"object-store", "gist", "paste", "webhook",
                                          "raw-content"}  # fmt: skip
    assert all(u.source.startswith("https://") and u.checked <= TODAY for u in services)
    names = [u.host for u in services]
    assert len(names) == len(set(names)), "a name listed twice"
    assert {"*.s3.amazonaws.com", "gist.github.com", "pastebin.com", "webhook.site",
            "*.githubusercontent.com", "upload.pypi.org"} <= set(names)  # fmt: skip


def test_a_bad_catalogue_is_refused_with_its_position(tmp_path):
    bad = tmp_path / "u.yaml"
    bad.write_text("catalogue: u\nservices:\n  - {provider: x, kind: paste, "
                   "source: http://x.test/, checked: 2026-01-01, hosts: [x.test]}\n")  # fmt: skip
    with pytest.raises(RulesError) as e:
        read_catalogue(bad)
    assert [str(p) for p in e.value.problems] == [
        f"{bad}:3:40: services[0].source: source must be the https:// URL of the "
        "provider's published list or documentation"]
    assert read_catalogue(CATALOGUE) == upload_services()


def _warnings(write_rules, allow: str, deny: str = "[]") -> list[str]:
    profile = f"profile: p\negress:\n  allow: {allow}\n  deny: {deny}\n"
    rs = load_rules(write_rules(profiles={"p": profile}))
    return [p.message for p in lint_ruleset(rs, TODAY)]


def test_wildcard_over_an_object_store_warns(write_rules):
    got = _warnings(write_rules, '[{host: "*.s3.amazonaws.com", id: s3, reason: r}]')
    assert got == [
        "entry 's3' is a wildcard over *.s3.amazonaws.com (object-store: aws-s3, "
        "https://docs.aws.amazon.com/general/latest/gr/s3.html), which accepts uploads from "
        "anyone: every name under it is a place to write data to; allow the exact names "
        "needed, or inspect it read-only (http: {methods: [GET, HEAD]})"]


@pytest.mark.parametrize("entry", [
    '{host: "*.amazonaws.com", reason: wider than the service}',
    '{host: "*.bucket.s3.amazonaws.com", reason: "narrower, still a wildcard"}',
    '{host: "*.webhook.site", reason: r, http: {methods: [GET, POST]}}',
    '{host: "*.githubusercontent.com", reason: r, host_must_match_sni: true}',
    '{host: "*.github.com", reason: r, http: {paths: ["/x/**"]}}',
])  # fmt: skip
def test_wildcards_that_can_still_write_warn(write_rules, entry):
    got = _warnings(write_rules, f"[{entry}]")
    assert len(got) == 1 and "is a wildcard over" in got[0], got


@pytest.mark.parametrize("entry", [
    '{host: "*.s3.amazonaws.com", reason: r, http: {methods: [GET, HEAD]}}',
    '{host: "*.githubusercontent.com", reason: r, http: {methods: [GET], paths: ["/a/**"]}}',
    '{host: "*.pythonhosted.org", reason: not an upload service}',
    '{host: objects.githubusercontent.com, reason: an exact name, host_must_match_sni: true}',
])  # fmt: skip
def test_read_only_or_unrelated_entries_do_not_warn(write_rules, entry):
    assert _warnings(write_rules, f"[{entry}]") == []


def test_a_deny_of_the_service_silences_the_wildcard(write_rules):
    got = _warnings(write_rules, '[{host: "*.r2.dev", id: r2, reason: r}]',
                    '[{host: "*.r2.dev", reason: never}]')  # fmt: skip
    assert all("wildcard over" not in m for m in got), got


def test_exact_upload_names_with_every_method_warn(write_rules):
    got = _warnings(write_rules, "[{host: pastebin.com, id: pb, reason: r}]")
    assert got == ["entry 'pb' reaches pastebin.com, which accepts uploads, without an "
                   "'http' block (limit methods/paths, e.g. GET/HEAD)"]


def test_shipped_rules_do_not_warn():
    root = Path(__file__).resolve().parents[2]
    for d in (root / "rules", root / "stockade" / "stack" / "demo_rules"):
        assert [str(p) for p in lint_ruleset(load_rules(d), TODAY)] == []

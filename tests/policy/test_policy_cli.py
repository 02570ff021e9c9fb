"""`stockade rules ...` end to end: in-process through stockade.cli.main, and the console
script once as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.cli import main

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "rules"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["rules", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_lint_and_test_pass_on_shipped_rules(capsys):
    rc, out, err = run(capsys, "lint", str(SHIPPED))
    assert rc == 0 and out == "" and "0 error(s)" in err
    rc, out, _ = run(capsys, "test", str(SHIPPED))
    last = out.strip().splitlines()[-1]
    assert rc == 0 and last.endswith(" passed, 0 failed") and int(last.split()[0]) >= 40


def test_shipped_profiles_exist():
    from stockade.policy import load_rules

    rs = load_rules(SHIPPED)
    assert {"pypi-build", "npm-build", "github-readonly", "no-network"} <= set(rs.profiles)
    assert {"pypi-readonly", "npm-readonly", "github-clone-readonly", "doh-deny"} <= set(
        rs.presets
    )
    for name in rs.profiles:
        assert any(c.profile == name for c in rs.tests), f"profile {name} has no policy test"


def test_lint_errors_exit_1_one_line_each(capsys, write_rules):
    root = write_rules(
        profiles={
            "p": "profile: p\negress:\n  allow:\n    - {host: 'a@b', reason: r}\n"
            "    - {host: c.test, ports: [0], reason: r}\n"
        }
    )
    rc, out, _ = run(capsys, "lint", str(root))
    lines = out.strip().splitlines()
    assert rc == 1 and len(lines) == 2
    where = f"{root}/profiles/p.yaml"
    assert lines[0].startswith(f"{where}:4:") and "egress.allow[0].host" in lines[0]
    assert lines[1].startswith(f"{where}:5:") and "egress.allow[1].ports[0]" in lines[1]
    rc, out, _ = run(capsys, "lint", "--json", str(root))
    data = json.loads(out)
    assert rc == 1 and data["errors"] == 2 and data["problems"][0]["line"] == 4


def test_lint_warnings_do_not_fail(capsys, write_rules):
    text = "profile: p\negress:\n  allow:\n    - {host: x.test, reason: r, expires: 2020-01-01}\n"
    root = write_rules(profiles={"p": text})
    rc, out, err = run(capsys, "lint", str(root / "profiles" / "p.yaml"))
    assert rc == 0 and "warning: entry 'p:allow:x.test' expired on 2020-01-01" in out
    assert "1 warning(s)" in err


def test_explain_human_and_json(capsys):
    rc, out, _ = run(capsys, "explain", "--rules", str(SHIPPED), "--profile", "pypi-build",
                     "-X", "POST", "https://upload.pypi.org/legacy/")  # fmt: skip
    assert rc == 1
    assert "verdict:  deny" in out and "reason:   denied_by_rule" in out
    assert "rule:     pypi-upload" in out and "pypi-readonly.yaml:" in out
    assert "why:      publishing packages is never part of a build" in out
    rc, out, _ = run(capsys, "explain", "--rules", str(SHIPPED), "--profile", "pypi-build",
                     "--json", "https://PyPI.org./simple/requests/")  # fmt: skip
    data = json.loads(out)
    assert rc == 0 and data["allowed"] and data["rule_id"] == "pypi-index"
    assert data["host"] == "pypi.org" and data["method"] == "GET"
    assert data["needs_inspection"] and len(data["policy_version"]) == 16


def test_explain_host_port_and_unknown_profile(capsys):
    rc, out, _ = run(capsys, "explain", "--rules", str(SHIPPED), "-p", "pypi-build",
                     "--json", "files.pythonhosted.org:443")  # fmt: skip
    doc = json.loads(out)
    # the file CDN is a shared front-end, inspected for Host = SNI: a bare flow needs L7
    assert rc == 1 and doc["method"] is None and doc["needs_inspection"]
    assert doc["reason"] == "inspection_unavailable" and doc["rule_id"] == "pypi-files"
    # an unknown profile is a usage error (2), not a deny (1); a close name is suggested
    rc, out, err = run(capsys, "explain", "--rules", str(SHIPPED), "-p", "pypi-buld",
                       "pypi.org:443")  # fmt: skip
    assert (rc, out) == (2, "")
    assert err == "explain: unknown profile 'pypi-buld'; did you mean 'pypi-build' or " \
                  "'npm-build'?\n"
    rc, _, err = run(capsys, "explain", "--rules", str(SHIPPED), "-p", "ghost", "pypi.org:443")
    assert rc == 2 and err == "explain: unknown profile 'ghost'\n"
    rc, _, err = run(capsys, "explain", "--rules", str(SHIPPED), "-p", "pypi-build",
                     "ftp://a.test/")  # fmt: skip
    assert rc == 2 and "unsupported URL scheme" in err


def test_explain_on_invalid_rules_exits_2(capsys, write_rules):
    root = write_rules(profiles={"p": "profile: p\nbogus: 1\n"})
    rc, _, err = run(capsys, "explain", "--rules", str(root), "-p", "p", "a.test:443")
    assert rc == 2 and "bogus: unknown key" in err


def test_test_failures_are_reported(capsys, write_rules):
    root = write_rules(
        profiles={"p": "profile: p\negress:\n  allow: [{host: a.test, reason: r}]\n"},
        tests={"t": """
        tests:
          - {profile: p, target: "a.test:443", expect: allow, rule: "p:allow:a.test"}
          - {profile: p, target: "https://a.test/", expect: deny}
          - {profile: p, target: "b.test:443", expect: deny, reason: denied_by_rule}
        """},
    )  # fmt: skip
    rc, out, _ = run(capsys, "test", str(root))
    lines = out.strip().splitlines()
    assert rc == 1 and lines[-1] == "1 passed, 2 failed"
    assert any("t.yaml:3:5: FAIL" in x and "expected deny, got allow" in x for x in lines)
    assert any("expected reason denied_by_rule, got no_matching_rule" in x for x in lines)
    rc, out, _ = run(capsys, "test", "--json", str(root / "tests" / "t.yaml"))
    data = json.loads(out)
    assert rc == 1 and data["passed"] == 1 and data["failed"] == 2


def test_report_mode_tests_describe_the_rules(capsys, write_rules):
    root = write_rules(
        profiles={"p": "profile: p\negress: {mode: report}\n"},
        tests={"t": "tests:\n  - {profile: p, target: 'a.test:443', expect: deny}\n"},
    )
    rc, out, _ = run(capsys, "test", str(root))
    assert rc == 0 and out.strip() == "1 passed, 0 failed"


def test_diff_cli(capsys, tmp_path):
    old = tmp_path / "old"
    new = tmp_path / "new"
    for d, hosts in ((old, ["a.test"]), (new, ["a.test", "b.test"])):
        (d / "profiles").mkdir(parents=True)
        entries = "".join(f"    - {{host: {h}, reason: r}}\n" for h in hosts)
        (d / "profiles" / "p.yaml").write_text(f"profile: p\negress:\n  allow:\n{entries}")
    rc, out, _ = run(capsys, "diff", str(old), str(new))
    assert rc == 0 and "profile p (changed)" in out and "+ b.test:443" in out
    rc, out, _ = run(capsys, "diff", "--json", str(new), str(old))
    data = json.loads(out)
    assert data["profiles"][0]["no_longer_allowed"] == ["b.test:443"]
    rc, out, _ = run(capsys, "diff", str(old), str(old))
    assert "no effective change" in out


@pytest.mark.parametrize("sub", ["lint", "explain", "test", "diff"])
def test_every_subcommand_has_help(capsys, sub):
    with pytest.raises(SystemExit) as e:
        main(["rules", sub, "--help"])
    assert e.value.code == 0 and "usage: stockade rules " + sub in capsys.readouterr().out


def test_console_script_runs():
    exe = Path(sys.executable).with_name("stockade")
    r = subprocess.run([str(exe), "rules", "test", str(SHIPPED)], capture_output=True,
                       text=True, check=False, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].endswith(" passed, 0 failed")


def test_lint_missing_dir_fails(capsys, tmp_path):
    rc, out, _ = run(capsys, "lint", str(tmp_path / "nope"))
    assert rc == 1 and "rules directory not found" in out


def test_explain_honours_today(capsys, write_rules):
    text = "profile: p\negress:\n  allow:\n    - {host: t.test, reason: r, expires: 2026-03-01}\n"
    root = write_rules(profiles={"p": text})
    args = ("explain", "--rules", str(root), "-p", "p", "t.test:443", "--today")
    assert run(capsys, *args, "2026-03-01")[0] == 0
    rc, out, _ = run(capsys, *args, "2026-03-02")
    assert rc == 1 and "no_matching_rule" in out


def test_shipped_github_grant_is_read_only():
    from stockade.policy import load_rules, match_operation

    grant = load_rules(SHIPPED).profiles["github-readonly"].broker["github"]
    assert match_operation(grant, "GET", "/repos/octo/hello/issues?state=open")
    assert match_operation(grant, "GET", "/repos/octo/hello/contents/src/main.py")
    for method, path in [
        ("POST", "/repos/octo/hello/issues"),
        ("PATCH", "/repos/octo/hello"),
        ("DELETE", "/repos/octo/hello"),
        ("PUT", "/repos/octo/hello/contents/x"),
        ("GET", "/user"),
        ("GET", "/repos/octo/hello/../../user"),
    ]:
        assert not match_operation(grant, method, path), (method, path)


def test_rules_option_is_accepted_by_lint_and_test(capsys):
    assert run(capsys, "lint", "--rules", str(SHIPPED))[0] == 0
    rc, out, _ = run(capsys, "test", "--rules", str(SHIPPED))
    assert rc == 0 and out.strip().endswith(" passed, 0 failed")


def test_explain_dns(capsys):
    base = ("explain", "--rules", str(SHIPPED), "--dns", "-p")
    rc, out, _ = run(capsys, *base, "pypi-build", "PyPI.org.")
    assert rc == 0 and "DNS lookup of pypi.org" in out and "rule:     pypi-index" in out
    rc, out, _ = run(capsys, *base, "no-network", "--json", "mozilla.cloudflare-dns.com")
    data = json.loads(out)
    assert rc == 1 and data["kind"] == "dns" and data["rule_id"] == "doh-cloudflare-sub"

"""Loading: every validation error names file:line:column and the key."""

from __future__ import annotations

import pytest
from stockade.policy import RulesError, load_rules

GOOD = """
profile: p
description: d
isolation: microvm
limits: {cpus: 2, memory: 1GiB, disk: 2GiB, pids: 128, ttl: 5m, egress_bytes: 100MB}
egress:
  allow:
    - host: Files.Example.ORG.
      reason: r
      expires: 2030-01-01
    - cidr: 10.0.0.0/24
      ports: [5432]
      reason: db
broker:
  apis:
    gh:
      operations: [{method: GET, path: "/repos/*/*/issues"}]
      rate: 30/min
      burst: 5
      budget: {calls: 100, bytes: 1MiB}
      max_body: 64KiB
exports: {max_file: 1MiB, max_total: 2MiB, types: [text]}
"""
API = """
api: gh
base_url: https://api.github.com
credential: {mount: secret, path: stockade/github, field: token}
inject: {style: header, header: X-Api-Key, template: "Token {secret}"}
"""


def errors(write_rules, **kinds) -> list[str]:
    with pytest.raises(RulesError) as ei:
        load_rules(write_rules(**kinds))
    return [str(p) for p in ei.value.problems]


def test_good_profile_loads_with_units(write_rules):
    rs = load_rules(write_rules(profiles={"p": GOOD}, apis={"gh": API}))
    p = rs.profiles["p"]
    assert p.isolation == "microvm"
    assert p.limits.memory == 2**30 and p.limits.ttl == 300 and p.limits.egress_bytes == 10**8
    assert p.allow[0].host == "files.example.org"
    assert p.allow[0].location is not None and p.allow[0].location.line == 7
    assert p.allow[1].ports == frozenset({5432})
    g = p.broker["gh"]
    assert g.rate_per_second == pytest.approx(0.5) and g.budget_bytes == 2**20
    assert g.max_body_bytes == 64 * 1024
    assert p.exports.max_file_bytes == 2**20
    inj = rs.apis["gh"].injection
    assert inj.style == "header" and inj.template == "Token {secret}"


def test_version_is_stable_and_content_sensitive(write_rules, tmp_path):
    a = load_rules(write_rules(profiles={"p": GOOD}, apis={"gh": API}))
    b = load_rules(a.root)
    assert a.version == b.version
    (tmp_path / "rules/profiles/p.yaml").write_text(GOOD.replace("reason: db", "reason: db2"))
    assert load_rules(a.root).version != a.version


@pytest.mark.parametrize(
    ("snippet", "message"),
    [
        ("    - {host: a.test, reason: r, colour: red}", ":33: egress.allow[0].colour: unknown"),
        ("    - {host: a.test}", "egress.allow[0].reason: required key is missing"),
        ("    - {host: a.test, reason: '  '}", "egress.allow[0].reason: reason must say"),
        ("    - {host: '[a.test]', reason: r}", "egress.allow[0].host: host contains forbidden"),
        ("    - {host: 'a@b.test', reason: r}", "egress.allow[0].host: host contains forbidden"),
        ("    - {host: 'a b.test', reason: r}", "egress.allow[0].host: host contains forbidden"),
        ("    - {host: \"a\\tb.test\", reason: r}", "egress.allow[0].host"),
        ("    - {host: 'a*.test', reason: r}", "egress.allow[0].host: '*' is only allowed"),
        ("    - {host: 'a.*.test', reason: r}", "egress.allow[0].host: '*' is only allowed"),
        ("    - {host: 'a..test', reason: r}", "egress.allow[0].host: empty label"),
        ("    - {host: '1.2.3.4', reason: r}", "use 'cidr:'"),
        ("    - {host: a.test, ports: [0], reason: r}", "egress.allow[0].ports[0]"),
        ("    - {host: a.test, ports: [65536], reason: r}", "egress.allow[0].ports[0]"),
        ("    - {host: a.test, ports: ['443'], reason: r}", "egress.allow[0].ports[0]"),
        ("    - {host: a.test, ports: [], reason: r}", "egress.allow[0].ports"),
        ("    - {cidr: 10.0.0.1/24, reason: r}", "egress.allow[0].cidr: invalid CIDR"),
        ("    - {host: a.test, cidr: 10.0.0.0/8, reason: r}", "exactly one of"),
        ("    - {reason: r}", "exactly one of"),
        ("    - {host: a.test, reason: r, expires: soon}", "egress.allow[0].expires"),
        ("    - {host: a.test, reason: r, http: {methods: [FETCH]}}", "unknown HTTP method"),
        ("    - {host: a.test, reason: r, http: {paths: [simple]}}", "must start with '/'"),
        ("    - {host: a.test, reason: r, id: 'has space'}", "egress.allow[0].id"),
    ],
)
def test_entry_errors(write_rules, snippet, message):
    where = ":5:"
    text = f"profile: p\negress:\n  allow:\n{snippet.replace('    - ', '    - ', 1)}\n"
    # the entry starts on line 4 col 7; its keys sit on the same line
    text = "# header\n" + text
    problems = errors(write_rules, profiles={"p": text})
    assert len(problems) >= 1
    assert any(where in p and message in p for p in problems), problems
    assert all(p.startswith(f"{write_rules()}/profiles/p.yaml:") for p in problems)


def test_error_points_at_the_value_line(write_rules):
    text = (
        "profile: p\negress:\n  allow:\n    - host: a.test\n      reason: r\n"
        "      ports: [22, 99999]\n"
    )
    (p,) = errors(write_rules, profiles={"p": text})
    assert ":6:19:" in p and "egress.allow[0].ports[1]" in p


def test_duplicate_yaml_key(write_rules):
    (p,) = errors(write_rules, profiles={"p": "profile: p\ndescription: a\ndescription: b\n"})
    assert p.endswith("description: duplicate key") and ":3:1:" in p


def test_yaml_syntax_error_has_position(write_rules):
    (p,) = errors(write_rules, profiles={"p": "profile: p\negress: [\n"})
    assert "invalid YAML" in p and "p.yaml:3:" in p


def test_wrong_types_and_unknown_top_level(write_rules):
    text = "profile: p\nisolation: docker\nlimits: {cpus: many, memory: 3 bananas}\nextra: 1\n"
    problems = errors(write_rules, profiles={"p": text})
    joined = "\n".join(problems)
    assert ":2:12: isolation:" in joined
    assert ":3:16: limits.cpus:" in joined
    assert "limits.memory: invalid size" in joined
    assert ":4:1: extra: unknown key" in joined


def test_duplicate_ids(write_rules):
    text = """
    profile: p
    egress:
      allow:
        - {host: a.test, reason: r, id: same}
        - {host: b.test, reason: r, id: same}
        - {host: c.test, reason: r}
        - {host: c.test, ports: [80], reason: r}
    """
    problems = errors(write_rules, profiles={"p": text})
    assert any("duplicate rule id 'same'" in p and ":5:" in p for p in problems)
    assert any("duplicate rule id 'p:allow:c.test'" in p for p in problems)


def test_cross_file_references(write_rules):
    text = """
    profile: p
    egress: {presets: [nope, nope]}
    broker: {apis: {gh: {operations: [{method: GET, path: /x}]}}}
    """
    tests = "tests:\n  - {profile: ghost, target: a.test:443, expect: deny}\n"
    problems = "\n".join(errors(write_rules, profiles={"p": text}, tests={"t": tests}))
    assert "egress.presets[0]: unknown preset 'nope'" in problems
    assert "egress.presets[1]: preset 'nope' listed twice" in problems
    assert "broker.apis.gh: unknown API 'gh'" in problems
    assert "t.yaml:2:15: tests[0].profile: unknown profile 'ghost'" in problems


def test_deny_entries_take_no_http(write_rules):
    text = "profile: p\negress:\n  deny:\n    - {host: a.test, reason: r, http: {methods: [GET]}}\n"
    (p,) = errors(write_rules, profiles={"p": text})
    assert "egress.deny[0]: deny entries take no 'http' block" in p


def test_duplicate_profile_names(write_rules):
    problems = errors(write_rules, profiles={"a": "profile: p\n", "b": "profile: p\n"})
    assert any("b.yaml:1:10: profile: duplicate profile name" in p for p in problems)


@pytest.mark.parametrize(
    ("inject", "message"),
    [
        ("{style: header}", "needs 'header'"),
        ("{style: basic}", "needs 'username'"),
        ("{style: query}", "needs 'param'"),
        ("{style: bearer, param: k}", "takes no param"),
        ("{style: header, header: X-K, template: 'Token'}", "must contain '{secret}'"),
        ("{style: magic}", "inject.style"),
    ],
)
def test_api_injection_errors(write_rules, inject, message):
    text = API.replace('{style: header, header: X-Api-Key, template: "Token {secret}"}', inject)
    problems = "\n".join(errors(write_rules, apis={"gh": text}))
    assert message in problems and "gh.yaml:" in problems


def test_api_base_url(write_rules):
    plain = API.replace("https://api.github.com", "http://api.test")
    assert "allow_plain_http" in "\n".join(errors(write_rules, apis={"gh": plain}))
    ok = load_rules(write_rules(apis={"gh": plain + "allow_plain_http: true\n"}))
    assert ok.apis["gh"].allow_plain_http
    userinfo = API.replace("https://api.github.com", "https://u:p@api.test")
    assert "userinfo" in "\n".join(errors(write_rules, apis={"gh": userinfo}))


def test_broker_rate_and_test_reason_values(write_rules):
    text = "profile: p\nbroker: {apis: {gh: {operations: [{method: GET, path: /x}], rate: 10}}}\n"
    assert "rate must be a string" in "\n".join(
        errors(write_rules, profiles={"p": text}, apis={"gh": API})
    )
    tests = "tests:\n  - {profile: p, target: a.test, expect: deny, reason: nope}\n"
    assert "tests[0].reason" in "\n".join(
        errors(write_rules, profiles={"p": "profile: p\n"}, tests={"t": tests})
    )


def test_missing_dir_and_empty_file(write_rules, tmp_path):
    with pytest.raises(RulesError, match="rules directory not found"):
        load_rules(tmp_path / "nope")
    (p,) = errors(write_rules, profiles={"p": ""})
    assert "empty file" in p
    (p,) = errors(write_rules, profiles={"p": "- a\n- b\n"})
    assert "expected a mapping" in p


def test_alias_loop_is_refused(write_rules):
    (p,) = errors(write_rules, profiles={"p": "profile: p\ndescription: &a [*a]\n"})
    assert "invalid YAML" in p or "nested too deeply" in p


def test_policy_test_with_unknown_rule_id(write_rules):
    tests = "tests:\n  - {profile: p, target: a.test, expect: deny, rule: typo}\n"
    problems = errors(write_rules, profiles={"p": "profile: p\n"}, tests={"t": tests})
    assert any("t.yaml:2:54: tests[0].rule: unknown rule id 'typo'" in p for p in problems)


PROXY_BASE = """
profile: p
egress:
  allow:
    - {host: a.test, reason: r}
"""


def test_proxy_env_defaults_to_false(write_rules):
    p = load_rules(write_rules(profiles={"p": PROXY_BASE})).profiles["p"]
    assert p.proxy_env is False


def test_proxy_env_true_loads_and_changes_the_version(write_rules, tmp_path):
    plain = load_rules(write_rules(profiles={"p": PROXY_BASE}))
    text = PROXY_BASE.replace("egress:\n", "egress:\n  proxy_env: true\n")
    (tmp_path / "rules/profiles/p.yaml").write_text(text)
    with_proxy = load_rules(plain.root)
    assert with_proxy.profiles["p"].proxy_env is True
    assert with_proxy.version != plain.version
    # the explicit default is a different document, but the same effective setting
    (tmp_path / "rules/profiles/p.yaml").write_text(
        PROXY_BASE.replace("egress:\n", "egress:\n  proxy_env: false\n"))
    assert load_rules(plain.root).profiles["p"].proxy_env is False
    assert load_rules(plain.root).version != with_proxy.version


@pytest.mark.parametrize("value", ["'true'", "1", "[true]", "{on: true}", "null"])
def test_proxy_env_is_a_strict_bool(write_rules, value):
    text = PROXY_BASE.replace("egress:\n", f"egress:\n  proxy_env: {value}\n")
    errs = errors(write_rules, profiles={"p": text})
    assert len(errs) == 1 and ":3:" in errs[0] and "egress.proxy_env" in errs[0], errs


def test_proxy_env_belongs_to_egress(write_rules):
    errs = errors(write_rules, profiles={"p": PROXY_BASE + "proxy_env: true\n"})
    assert any("proxy_env: unknown key" in e for e in errs), errs


def test_selftest_is_required_unless_a_profile_samples_it(write_rules, tmp_path):
    plain = load_rules(write_rules(profiles={"p": PROXY_BASE}))
    assert plain.profiles["p"].selftest == "required"
    (tmp_path / "rules/profiles/p.yaml").write_text(PROXY_BASE + "selftest: sampled\n")
    sampled = load_rules(plain.root)
    assert sampled.profiles["p"].selftest == "sampled"
    assert sampled.version != plain.version


@pytest.mark.parametrize("value", ["off", "true", "'Required'", "null"])
def test_selftest_takes_only_its_two_values(write_rules, value):
    errs = errors(write_rules, profiles={"p": PROXY_BASE + f"selftest: {value}\n"})
    assert len(errs) == 1 and ":5:11: selftest: " in errs[0], errs

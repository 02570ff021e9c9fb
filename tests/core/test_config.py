import pytest

from stockade.config import ConfigError, load_config


def test_defaults_without_file():
    cfg = load_config(None)
    assert cfg.rules_dir == "rules"
    assert str(cfg.events_file) == "/var/log/stockade/events.jsonl"


def test_sections_and_overrides(tmp_path):
    p = tmp_path / "stockade.yaml"
    p.write_text(
        "state_dir: /tmp/s\n"
        "events: {file: /tmp/e.jsonl, stdout: true}\n"
        "gateway:\n  allow_addresses: [10.250.0.0/24]\n  resolvers: [10.250.0.53]\n"
    )
    cfg = load_config(p)
    assert cfg.state_dir == "/tmp/s"
    assert cfg.gateway.allow_addresses == ["10.250.0.0/24"]
    assert str(cfg.events_file) == "/tmp/e.jsonl"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("gatway: {}\n", "gatway"),  # unknown key (typo)
        ("gateway:\n  sniff_timeout_s: -1\n", "sniff_timeout_s"),
        ("state_dir: a\nstate_dir: b\n", "duplicate key 'state_dir'"),
        ("- a list\n", "mapping"),
        ("gateway: [unclosed\n", "invalid YAML"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, text, needle):
    p = tmp_path / "stockade.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert needle in str(e.value)
    assert str(p) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")

"""Secrets for the dev OpenBao come from a file or stdin, never from argv or the config."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from stockade.broker.settings import DevSecret

from stockade.stack.devsecrets import (
    SecretSpecError,
    from_settings,
    parse_secret_arg,
    parse_secret_args,
)


def test_value_from_a_file_drops_one_newline(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    v = parse_secret_arg(f"stockade/demo-api:token=@{f}")
    assert (v.path, v.field, v.value) == ("stockade/demo-api", "token", "s3cret")
    assert "s3cret" not in repr(v)


def test_value_from_stdin() -> None:
    v = parse_secret_arg("a/b:c=@-", io.StringIO("from-stdin\n"))
    assert v.value == "from-stdin"


@pytest.mark.parametrize(
    ("arg", "needle"),
    [
        ("a/b:c=literal-value", "visible to every local user"),
        ("a/b:c=@", "visible to every local user"),
        ("a/b=@x", "expected PATH:FIELD"),
        ("a/../b:c=@x", "expected PATH:FIELD"),
        ("a/b:c", "expected PATH:FIELD"),
        ("a/b:c=@/nonexistent/file", "cannot read"),
    ],
)
def test_bad_specs_are_clear_errors(arg: str, needle: str) -> None:
    with pytest.raises(SecretSpecError, match=needle) as e:
        parse_secret_arg(arg)
    assert "literal-value" not in str(e.value)


def test_empty_value_and_two_stdins_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecretSpecError, match="empty"):
        parse_secret_arg(f"a:b=@{tmp_path / 'empty'}")
    with pytest.raises(SecretSpecError, match="only one"):
        parse_secret_args(["a:b=@-", "a:c=@-"], io.StringIO("x"))


def test_settings_name_the_entry_that_failed(tmp_path: Path) -> None:
    (tmp_path / "ok").write_text("v")
    items = [DevSecret(path="a", field="b", file=str(tmp_path / "ok")),
             DevSecret(path="c", field="d", file=str(tmp_path / "missing"))]
    with pytest.raises(SecretSpecError, match=r"dev_vault.secrets\[1\] \(c:d\)"):
        from_settings(items)
    assert [v.value for v in from_settings(items[:1])] == ["v"]


@pytest.mark.parametrize("path", ["a/../b", "..", "a/./b", "/abs", "a b"])
def test_setting_paths_are_plain_kv_paths(path: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        DevSecret(path=path, field="f", file="/x")


def test_secrets_need_the_dev_openbao() -> None:
    """A stack with a configured Vault (or one started by other means) takes no --secret."""
    from stockade.config import Config
    from stockade.stack.devsecrets import SecretValue
    from stockade.stack.services import StackError, put_dev_secrets

    cfg = Config(vault={"address": "https://vault.example:8200", "token_file": "/t"})
    with pytest.raises(StackError, match="uses a configured Vault"):
        put_dev_secrets(cfg, False, [SecretValue("a", "b", "v")])

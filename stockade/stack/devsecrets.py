"""Secrets for the embedded dev OpenBao: from `dev_vault.secrets` (files) or `--secret
PATH:FIELD=@FILE` / `=@-` (standard input) on `stockade run` and `stockade up`.

A value never comes from argv (every local user sees it in `ps`) nor from the config text:
only from a file or stdin, read when the stack (or the run) needs it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from stockade.broker.settings import DevSecret

_TARGET = re.compile(
    r"^(?P<path>[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*):(?P<field>[A-Za-z0-9_.-]+)\Z")
ARG_HELP = ("put a secret into the embedded dev OpenBao (KV v2 under secret/): PATH:FIELD=@FILE "
            "reads the value from FILE, PATH:FIELD=@- from standard input (never a value on the "
            "command line); repeatable; needs the dev OpenBao (no vault.address)")


class SecretSpecError(ValueError):
    pass


@dataclass(frozen=True)
class SecretValue:
    path: str
    field: str
    value: str = field(repr=False)  # kept out of reprs, tracebacks and logs


def _read_value(source: str, stdin: IO[str] | None) -> str:
    if source == "-":
        text = (stdin or sys.stdin).read()
    else:
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise SecretSpecError(f"cannot read {source}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise SecretSpecError(f"{source}: not UTF-8 text") from None
    value = text[:-1] if text.endswith("\n") else text
    if not value:
        raise SecretSpecError(f"{'standard input' if source == '-' else source} is empty")
    return value


def parse_secret_arg(arg: str, stdin: IO[str] | None = None) -> SecretValue:
    """`PATH:FIELD=@FILE` or `PATH:FIELD=@-`; a literal value is refused."""
    target, sep, source = arg.partition("=")
    m = _TARGET.match(target)
    if not sep or m is None or {".", ".."} & set(m["path"].split("/")):
        raise SecretSpecError(f"--secret {target!r}: expected PATH:FIELD=@FILE or PATH:FIELD=@-")
    if not source.startswith("@") or len(source) < 2:
        # the value itself is not echoed: it may be the secret
        raise SecretSpecError(
            f"--secret {target}: give the value as =@FILE or =@- (a value on the command "
            "line is visible to every local user in ps)"
        )
    try:
        value = _read_value(source[1:], stdin)
    except SecretSpecError as e:
        raise SecretSpecError(f"--secret {target}: {e}") from None
    return SecretValue(m["path"], m["field"], value)


def parse_secret_args(args: Iterable[str], stdin: IO[str] | None = None) -> list[SecretValue]:
    args = list(args)
    if sum(a.endswith("=@-") for a in args) > 1:
        raise SecretSpecError("--secret: only one value can come from standard input (=@-)")
    return [parse_secret_arg(a, stdin) for a in args]


def from_settings(items: Iterable[DevSecret]) -> list[SecretValue]:
    out = []
    for i, item in enumerate(items):
        try:
            out.append(SecretValue(item.path, item.field, _read_value(item.file, None)))
        except SecretSpecError as e:
            where = f"dev_vault.secrets[{i}] ({item.path}:{item.field})"
            raise SecretSpecError(f"{where}: {e}") from None
    return out


def put_secrets(address: str, token: str, values: Iterable[SecretValue]) -> None:
    """Write the values, one KV v2 write per path (fields of a path merged)."""
    from stockade.testing.devvault import merge_secret

    by_path: dict[str, dict[str, str]] = {}
    for v in values:
        by_path.setdefault(v.path, {})[v.field] = v.value
    for path, fields in by_path.items():
        merge_secret(address, token, path, fields)

"""The shells of `stockade rules schema` and `stockade rules fmt` (the editor's and the
pipeline's side of the rule files): options, files in and out, exit codes. The cores
are jsonschema_doc.py and fmt.py; the parsers are wired with the others in policy/cli.py."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .kinds import KINDS

SCHEMA_SUMMARY = "write the JSON Schema of the rule files (for editors)"
SCHEMA_DESCRIPTION = (
    "Print (or write with --output) the JSON Schema of the rule files, generated from the "
    "models the loader validates with. Without --kind it matches any rule file (profiles, "
    "presets, apis, tests, catalogues). Point an editor at it with a first line "
    "'# yaml-language-server: $schema=<path or URL>' (docs/rules.md). Exit 0; 2 when the "
    "output cannot be written."
)
FMT_SUMMARY = "rewrite rule files in canonical order and style (--check: only report)"
FMT_DESCRIPTION = (
    "Put rule files in canonical form: keys in the schema's order, two-space indentation, "
    "comments, quotes and flow/block style kept. PATH is a rules directory (every file of "
    "its profiles/, presets/, apis/, tests/, catalogues/) or one file inside one; default "
    "./rules. With --check nothing is written: the files that are not canonical are "
    "listed (with --diff, as a unified diff) and the exit code is 1. Exit 2 when a file "
    "cannot be read or formatted (it is left as it is)."
)


def add_schema_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", choices=sorted(KINDS),
                   help="the schema of one kind of file (its folder's name)")  # fmt: skip
    p.add_argument("--output", "-o", metavar="FILE", help="write the schema to FILE")


def cmd_schema(args: argparse.Namespace) -> int:
    from .jsonschema_doc import rule_file_schema

    text = json.dumps(rule_file_schema(args.kind), indent=2) + "\n"
    if not args.output:
        sys.stdout.write(text)
        return 0
    try:
        _write(Path(args.output), text)
    except OSError as e:
        print(f"stockade rules schema: cannot write {args.output}: {e}", file=sys.stderr)
        return 2
    return 0


def add_fmt_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="rules directory or a file inside one; default ./rules")  # fmt: skip
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when a file is not canonical")
    p.add_argument("--diff", action="store_true",
                   help="with --check: show what would change as a unified diff")


def cmd_fmt(args: argparse.Namespace) -> int:
    from .fmt import FmtError, format_text
    from .schemawalk import KIND_MODELS

    failed = changed = 0
    for path, kind in _rule_files(args.paths or ["rules"]):
        if kind is None:
            print(f"{path}:1:1: not a rule file (expected a .yaml file in one of "
                  f"{', '.join(sorted(KINDS))}/)", file=sys.stderr)  # fmt: skip
            failed += 1
            continue
        try:
            text = path.read_text(encoding="utf-8")
            canonical = format_text(text, KIND_MODELS[kind])
        except (OSError, UnicodeDecodeError) as e:
            print(f"{path}:1:1: cannot read: {e}", file=sys.stderr)
            failed += 1
            continue
        except FmtError as e:
            print(f"{path}:{e.line}:{e.column}: {e.message}", file=sys.stderr)
            failed += 1
            continue
        if canonical == text:
            continue
        changed += 1
        if not _report_or_write(args, path, text, canonical):
            failed += 1
    verb = "would be reformatted" if args.check else "reformatted"
    print(f"{changed} file(s) {verb}, {failed} failed", file=sys.stderr)
    if failed:
        return 2
    return 1 if args.check and changed else 0


def _report_or_write(args: argparse.Namespace, path: Path, text: str, canonical: str) -> bool:
    """--check: name the file (and its diff); else rewrite it. False when it failed."""
    if args.check:
        print(f"{path}: not canonical (run 'stockade rules fmt {path}')")
        if args.diff:
            old, new = text.splitlines(True), canonical.splitlines(True)
            sys.stdout.writelines(difflib.unified_diff(old, new, str(path), f"{path} (fmt)"))
        return True
    try:
        _write(path, canonical)
    except OSError as e:
        print(f"{path}:1:1: cannot write: {e}", file=sys.stderr)
        return False
    print(f"{path}: reformatted")
    return True


def _rule_files(paths: list[str]) -> Iterator[tuple[Path, str | None]]:
    """(file, its kind or None) for each PATH: a file, or every rule file of a directory
    (a rules directory, or one of its kind folders), in the models' order."""
    from .schemawalk import KIND_MODELS

    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            kind = path.parent.name
            yield path, kind if kind in KIND_MODELS and path.suffix in (".yaml", ".yml") else None
            continue
        folders = [path] if path.name in KIND_MODELS else [path / k for k in KIND_MODELS]
        for folder in folders:
            if folder.is_dir():
                for f in sorted(folder.iterdir()):
                    if f.suffix in (".yaml", ".yml") and f.is_file():
                        yield f, folder.name


def _write(path: Path, text: str) -> None:
    """Replace `path` whole (a crash never leaves half a file), keeping its mode."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

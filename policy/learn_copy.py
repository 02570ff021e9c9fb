"""A temporary copy of a rules directory with one profile switched to report mode, for
`stockade rules learn --profile P -- CMD` on an enforcing profile: the task then runs
against the copy (`stockade run --rules COPY`), so what it needs beyond the profile's
entries is logged instead of denied, and the user's files are never written.

The profile's own file is rewritten round-trip (ruamel: everything else as it was); the
copy is loaded again and must have the profile in report mode, else it is refused."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError


class CopyError(Exception):
    """The copy could not be made (said to the user; learn then refuses the profile)."""


def report_mode_copy(rules_dir: str | Path, profile: Any) -> Path:
    """A new temporary directory holding `rules_dir` with `profile` (as loaded from it)
    in `egress.mode: report`; the caller removes it (`shutil.rmtree`)."""
    src = Path(rules_dir).resolve()
    if profile.location is None:
        raise CopyError(f"profile {profile.name!r} has no file in {rules_dir}")
    try:
        rel = Path(profile.location.file).resolve().relative_to(src)
    except ValueError:
        raise CopyError(f"profile {profile.name!r}'s file is outside {rules_dir}") from None
    tmp = Path(tempfile.mkdtemp(prefix="stockade-learn-rules-"))
    try:
        copy = tmp / "rules"
        shutil.copytree(src, copy)
        _switch_to_report(copy / rel)
        _check(copy, profile.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return copy


def remove_copy(copy: Path) -> None:
    shutil.rmtree(copy.parent, ignore_errors=True)


def _switch_to_report(path: Path) -> None:
    yaml = YAML()  # round-trip: comments, order and style of the rest are kept
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, YAMLError) as e:
        raise CopyError(f"cannot read {path.name}: {e}") from None
    if not isinstance(doc, CommentedMap):
        raise CopyError(f"{path.name} is not a mapping")
    egress = doc.get("egress")
    if egress is None:
        doc["egress"] = egress = CommentedMap()
    if not isinstance(egress, CommentedMap):
        raise CopyError(f"{path.name}: egress is not a mapping")
    egress["mode"] = "report"
    try:
        with path.open("w", encoding="utf-8") as fh:
            yaml.dump(doc, fh)
    except OSError as e:
        raise CopyError(f"cannot write the copy of {path.name}: {e}") from None


def _check(copy: Path, name: str) -> None:
    from .loader import load_rules
    from .problems import RulesError

    try:
        profile = load_rules(copy).profiles.get(name)
    except RulesError as e:
        raise CopyError(f"the report-mode copy does not load: {e}") from None
    if profile is None or profile.mode != "report":
        raise CopyError(f"profile {name!r} is not in report mode in the copy")

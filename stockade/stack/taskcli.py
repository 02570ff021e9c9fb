"""`stockade task verify RECORD`: check a signed task record (docs/task-record.md): its
signature, its rule-set version against a rules directory, its chain digests against
event files. On the top floor: it loads rules (the rule model) and the event checks
(ground) together."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stockade.events.chainkey import PUB_FILE, ChainError, load_public_key
from stockade.events.recordcheck import as_json, check_record
from stockade.events.verify import rotations

VERIFY_HELP = "check a task record's signature, rule-set hash and event chains"
VERIFY_DESCRIPTION = (
    "Check a signed task record (stockade-record.json, or a record event line): the "
    "Ed25519 signature of its DSSE envelope, with --rules the rule-set version against that "
    "rules directory, with --events the digests of the task's last events against those "
    "event files (and their hash chains). Exit 0 when every check holds, 1 when one fails, "
    "2 on a usage or read error.")


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    group = sub.add_parser("task", help="task records: verify a signed stockade-record.json")
    v = group.add_subparsers(dest="task_command", metavar="COMMAND").add_parser(
        "verify", help=VERIFY_HELP, description=VERIFY_DESCRIPTION)
    group.set_defaults(group_parser=group)
    v.add_argument("record", metavar="RECORD", help="the record file")
    v.add_argument("--rules", metavar="DIR", help="rules directory the record's version must be")
    v.add_argument("--events", nargs="+", metavar="FILE",
                   help="event files with the task's events (rotated files too)")
    v.add_argument("--key", metavar="PUB", help="the host's public key, PEM "
                   "(default: <events.chain_dir>/signing.pub)")
    v.add_argument("--heads", metavar="DIR",
                   help="signed stream heads for truncation (default without --key: "
                   "<events.chain_dir>/heads)")
    v.add_argument("--config", help="stockade.yaml (for the key and heads location)")
    v.add_argument("--json", action="store_true", help="print the result as one JSON object")
    v.set_defaults(func=_verify)


def read_envelope(path: Path) -> Any:
    """The envelope in a record file: the file itself, or a record event's."""
    doc = json.loads(path.read_text())
    if isinstance(doc, dict) and "payloadType" not in doc:
        inner = (doc.get("stockade") or {}).get("record")
        if isinstance(inner, dict):
            return inner
    return doc


def _rules_version(rules: str) -> str:
    """The rule-set version of a rules directory; ValueError saying why it has none."""
    from stockade.policy import load_rules  # type: ignore[attr-defined]
    from stockade.policy.problems import RulesError

    try:
        return str(load_rules(rules).version)
    except RulesError as e:
        raise ValueError(f"--rules {rules}: {e}") from None


def _key_and_heads(args: argparse.Namespace) -> tuple[str, Path | None]:
    """--key and --heads; without --key both come from this host's stockade.yaml (a key
    given by hand is another host's, whose heads are not here)."""
    key, heads = args.key, Path(args.heads) if args.heads else None
    if key is None:
        cfg = args.config_loader(args.config, "task verify")
        chain_dir = cfg.events.chain_dir
        if chain_dir:
            key = key or str(Path(chain_dir) / PUB_FILE)
            heads = heads if heads is not None else Path(chain_dir) / "heads"
    if key is None:
        raise ChainError("give the host's public key (--key signing.pub)")
    return key, heads


def _verify(args: argparse.Namespace) -> int:
    try:
        key, heads = _key_and_heads(args)
        pub = load_public_key(key)
        envelope = read_envelope(Path(args.record))
        version = _rules_version(args.rules) if args.rules else None
        files = [f for e in args.events or [] for f in (rotations(Path(e)) or [Path(e)])]
        record, checks = check_record(envelope, pub, rules_version=version,
                                      event_files=files or None, heads=heads)
    except (ChainError, OSError, ValueError) as e:
        print(f"stockade task verify: {e}", file=sys.stderr)
        return 2
    ok = all(c.ok for c in checks)
    if args.json:
        print(json.dumps(as_json(record, checks)))
    else:
        for c in checks:
            print(c)
        tid = (record or {}).get("task_id", "?")
        print(f"task {tid}: {'verified' if ok else 'NOT verified'}")
    return 0 if ok else 1

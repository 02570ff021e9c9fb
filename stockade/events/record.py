"""The signed task record: one JSON document per task, in a DSSE envelope signed with
the host's Ed25519 event-chain key (chainkey.py). docs/task-record.md describes both.

DSSE (github.com/secure-systems-lab/dsse, v1.0): the signature covers the
pre-authentication encoding `PAE(payloadType, payload)` =
`"DSSEv1" SP LEN(type) SP type SP LEN(payload) SP payload`, so a signature over a record
never verifies as anything else. The envelope is
`{"payloadType", "payload": base64(record JSON), "signatures": [{"keyid", "sig"}]}`;
`keyid` is chainkey.key_id of the public key (the one the chain's checkpoints carry).

The record's `chains` name, per component, the last line of the task's event store
(taskstore.py) that component wrote: its stream, sequence and digest (chain.digest of
the line as written, the `prev` its successor in the stream carries). recordcheck.py
verifies them against the event files.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .chain import digest
from .chainkey import key_id
from .taskstore import task_file

PAYLOAD_TYPE = "application/vnd.stockade.task-record.v1+json"
RECORD_FILE = "stockade-record.json"  # its name in a run's --export directory
Record = dict[str, Any]


class RecordError(ValueError):
    """An envelope that is malformed or whose signature does not verify."""


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def canonical(record: Record) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


def sign(record: Record, key: Ed25519PrivateKey) -> dict[str, Any]:
    payload = canonical(record)
    return {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": key_id(key.public_key()),
                            "sig": base64.b64encode(key.sign(pae(PAYLOAD_TYPE, payload)))
                            .decode()}]}


def open_envelope(envelope: Any, pub: Ed25519PublicKey) -> Record:
    """The record of an envelope one of whose signatures `pub` made; else RecordError."""
    if not isinstance(envelope, dict) or envelope.get("payloadType") != PAYLOAD_TYPE:
        raise RecordError(f"not a task record envelope (payloadType must be {PAYLOAD_TYPE})")
    try:
        payload = base64.b64decode(envelope["payload"], validate=True)
        sigs = [(s["keyid"], base64.b64decode(s["sig"], validate=True))
                for s in envelope["signatures"]]
    except (KeyError, TypeError, binascii.Error) as e:
        raise RecordError(f"malformed envelope: {e!r}") from None
    kid = key_id(pub)
    for keyid, sig in sigs:
        if keyid != kid:
            continue
        try:
            pub.verify(sig, pae(PAYLOAD_TYPE, payload))
        except InvalidSignature:
            raise RecordError("the signature does not verify: the record was changed "
                              "after it was signed, or signed by another key") from None
        try:
            record = json.loads(payload)
        except ValueError as e:
            raise RecordError(f"the signed payload is not JSON: {e}") from None
        if not isinstance(record, dict):
            raise RecordError("the signed payload is not a JSON object")
        return record
    raise RecordError(f"no signature by key {kid} (signed by "
                      f"{', '.join(k for k, _ in sigs) or 'nobody'})")


def component_of(ev: Any) -> str | None:
    """`stockade.component` of an event line in either format (ECS, OCSF)."""
    if not isinstance(ev, dict):
        return None
    st = ev.get("stockade") if "class_uid" not in ev else \
        (ev.get("unmapped") or {}).get("stockade")
    comp = st.get("component") if isinstance(st, dict) else None
    return comp if isinstance(comp, str) else None


def chain_of(ev: dict[str, Any]) -> tuple[Any, Any]:
    """(chain object, sequence number) of an event line in either format."""
    if "class_uid" in ev:  # OCSF lines (ocsf.py)
        return (ev.get("unmapped") or {}).get("chain"), (ev.get("metadata") or {}).get("sequence")
    return (ev.get("stockade") or {}).get("chain"), (ev.get("event") or {}).get("sequence")


def last_lines(task_dir: str | Path, task_id: str) -> dict[str, dict[str, Any]]:
    """Per component: stream, sequence and digest of its last chained line in the task's
    store (the lines as every writer wrote them to the shared file too)."""
    path = task_file(Path(task_dir), task_id)
    out: dict[str, dict[str, Any]] = {}
    if path is None:
        return out
    try:
        data = path.read_bytes()
    except OSError:
        return out
    for line in data.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a line still being written
        comp = component_of(ev)
        chain, seq = chain_of(ev) if isinstance(ev, dict) else (None, None)
        if comp is None or not isinstance(chain, dict) or not isinstance(seq, int):
            continue
        out[comp] = {"stream": chain.get("stream"), "seq": seq, "digest": digest(line)}
    return out

"""A session's signed task record as the SDK answers it (`GET /v1/sessions/{id}/record`):
the DSSE envelope decoded into a `TaskRecord`, verified against the host's public key when
the caller has it (the launcher host's `<events.chain_dir>/signing.pub`, SPKI PEM). The
key is never fetched from the launcher itself: a record checked with the key of the
same server that answered it proves nothing about that server. Pure but for reading a
key file.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from stockade.events.chainkey import key_id
from stockade.events.record import PAYLOAD_TYPE, RecordError, open_envelope

from .errors import BadRequest, RecordInvalid
from .models import TaskRecord
from .wire import as_json

PublicKey = Ed25519PublicKey | bytes | str | os.PathLike[str]


def public_key(key: PublicKey) -> Ed25519PublicKey:
    """`key` as an Ed25519 public key: the key itself, its PEM bytes, or a PEM file's
    path; BadRequest (field `public_key`) for anything else."""
    if isinstance(key, Ed25519PublicKey):
        return key
    pem = key
    if not isinstance(key, bytes):
        try:
            with open(key, "rb") as fh:
                pem = fh.read()
        except OSError as e:
            raise BadRequest(f"public key {key}: {e.strerror or e}", field="public_key"
                             ) from None
    try:
        loaded = serialization.load_pem_public_key(pem)  # type: ignore[arg-type]
    except ValueError as e:
        raise BadRequest(f"not a PEM public key: {e}", field="public_key") from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise BadRequest("not an Ed25519 public key (the host's signing.pub)",
                         field="public_key")
    return loaded


def _unverified(envelope: dict[str, Any]) -> dict[str, Any]:
    if envelope.get("payloadType") != PAYLOAD_TYPE:
        raise RecordInvalid(f"not a task record envelope (payloadType must be {PAYLOAD_TYPE})")
    try:
        record = json.loads(base64.b64decode(envelope["payload"], validate=True))
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise RecordInvalid(f"malformed envelope: {e!r}") from None
    if not isinstance(record, dict):
        raise RecordInvalid("the envelope's payload is not a JSON object")
    return record


def task_record(status: int, body: bytes, key: PublicKey | None = None) -> TaskRecord:
    """The answer of the record route; with `key`, RecordInvalid unless one of its
    signatures is that key's and verifies."""
    envelope = as_json(status, body)
    if key is None:
        return TaskRecord(envelope=envelope, record=_unverified(envelope))
    pub = public_key(key)
    try:
        record = open_envelope(envelope, pub)
    except RecordError as e:
        raise RecordInvalid(str(e)) from None
    return TaskRecord(envelope=envelope, record=record, verified=True, key_id=key_id(pub))

"""The SDK's sans-IO core: requests as the contract names them, NDJSON however it is cut,
refusals as their classes, denial summaries. No sockets."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stockade.client import (
    BadRequest,
    NotFound,
    PathRefused,
    StockadeError,
    TransportError,
    denial_summary,
    summarize_denials,
    wire,
)
from stockade.client.errors import CODES, error_from_body

EXIT = {"type": "exit", "exit_code": 3, "ended_by": "exit", "duration_s": 0.5,
        "denials": [{"event": {"reason": "dns_denied"}}], "stdout_truncated": False,
        "stderr_truncated": True}
LINES = [{"type": "stdout", "data": "a\n"}, {"type": "stderr", "data": "é"},
         {"type": "stdout", "data": "b"}, EXIT]
STREAM = b"".join(json.dumps(x).encode() + b"\n" for x in LINES)


def test_exec_call_body():
    call = wire.exec_call("abc", ["python3", "-c", "1"], env={"A": "1"}, cwd="w",
                          stdin=b"\x00\xff", timeout_s=2.5)
    assert (call.method, call.path, call.stream, call.long) == (
        "POST", "/v1/sessions/abc/exec", True, True)
    assert call.json == {"argv": ["python3", "-c", "1"], "env": {"A": "1"}, "cwd": "w",
                         "stdin_b64": "AP8=", "timeout_s": 2.5}
    assert wire.exec_call("abc", ["cat"], stdin="hi").json == {"argv": ["cat"], "stdin": "hi"}


@pytest.mark.parametrize("argv", ["ls -l", [], b"ls", ["ls", None], ["ls", 1]])
def test_exec_call_refuses_a_string_or_nothing(argv):
    with pytest.raises(ValueError, match="argv"):
        wire.exec_call("abc", argv)


def test_session_ids_stay_in_one_path_segment():
    assert wire.get("../sandboxes").path == "/v1/sessions/..%2Fsandboxes"
    assert wire.write_file("s1", "a/b.txt", "x").params == {"path": "a/b.txt"}
    assert wire.write_file("s1", "a", "é").content == "é".encode()
    assert wire.list_files("s1").params == {"list": "."}
    assert wire.write_file("s1", "a", bytearray(b"\x00")).content == b"\x00"
    with pytest.raises(TypeError, match="bytes or str"):
        wire.write_file("s1", "a", 5)  # type: ignore[arg-type]


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=8))
def test_ndjson_cut_anywhere(cuts):
    dec = wire.ExecDecoder()
    chunks = []
    edges = [0, *sorted(set(cuts)), len(STREAM)]
    for a, b in itertools.pairwise(edges):
        chunks += dec.feed(STREAM[a:b])
    res = dec.close()
    assert [(c.type, c.data) for c in chunks] == [("stdout", "a\n"), ("stderr", "é"),
                                                   ("stdout", "b")]
    assert (res.stdout, res.stderr, res.exit_code, res.ended_by) == ("a\nb", "é", 3, "exit")
    assert res.stderr_truncated and res.denials == EXIT["denials"] and not res.ok


def test_streamed_output_is_not_kept_twice():
    dec = wire.ExecDecoder(keep=False)
    assert len(dec.feed(STREAM)) == 3
    assert dec.close().stdout == ""


def test_last_line_without_newline():
    dec = wire.ExecDecoder()
    dec.feed(STREAM.rstrip(b"\n"))
    assert dec.close().exit_code == 3


@pytest.mark.parametrize("body, message", [
    (STREAM.split(json.dumps(EXIT).encode())[0], "before its exit line"),
    (STREAM + b'{"type": "stdout", "data": "late"}\n', "after its exit line"),
    (b"not json\n", "not JSON"),
    (b'{"type": "banner"}\n', "unknown type"),
    (b'{"type": "exit", "ended_by": "exit"}\n', "shape"),  # no exit_code
])
def test_broken_streams_are_transport_errors(body, message):
    dec = wire.ExecDecoder()
    with pytest.raises(TransportError, match=message):
        dec.feed(body)
        dec.close()


def test_error_line_mid_stream_raises_its_class():
    dec = wire.ExecDecoder()
    with pytest.raises(NotFound, match="gone"):
        dec.feed(b'{"type": "error", "error": "not_found", "detail": "gone"}\n')


def test_an_endless_line_is_refused():
    dec = wire.ExecDecoder()
    with pytest.raises(TransportError, match="longer"):
        dec.feed(b"x" * (wire.MAX_LINE + 1))


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_stable_code_has_its_class(code):
    body = json.dumps({"error": code, "detail": "why", "field": "argv"}).encode()
    with pytest.raises(CODES[code]) as ei:
        wire.check(400, body)
    assert (ei.value.code, ei.value.detail, ei.value.field, ei.value.status) == (
        code, "why", "argv", 400)
    assert str(ei.value) == f"{code}: why (field argv)"


def test_unknown_code_and_foreign_bodies():
    e = error_from_body(503, {"error": "shutting_down", "detail": "stopping"})
    assert type(e) is StockadeError and e.code == "shutting_down"
    with pytest.raises(StockadeError) as ei:
        wire.check(502, b"<html>bad gateway</html>")
    assert ei.value.code == "http_502" and "bad gateway" in ei.value.detail
    assert isinstance(error_from_body(400, {"error": "path_refused"}), PathRefused)
    assert issubclass(BadRequest, StockadeError)


def test_answers_of_the_wrong_shape():
    with pytest.raises(TransportError, match="not JSON"):
        wire.session(200, b"<html>")
    with pytest.raises(TransportError, match="shape"):
        wire.session(200, b'{"session_id": "x"}')
    with pytest.raises(TransportError, match="sessions"):
        wire.sessions(200, b"{}")


def _denial(reason, domain=None, ip=None, port=None):
    dst = {k: v for k, v in (("domain", domain), ("ip", ip), ("port", port)) if v}
    return {"event": {"reason": reason, "action": "x"}, "destination": dst}


def test_denial_summary_counts_by_reason_and_destination():
    evs = [_denial("dns_denied", "evil.example", port=53)] * 3 + [
        _denial("not_allowed", ip="2001:db8::1", port=443), _denial("not_allowed", "a.test"),
        {"event": {}}]
    assert summarize_denials(evs) == [
        ("dns_denied", "evil.example:53", 3), ("denied", "?", 1),
        ("not_allowed", "[2001:db8::1]:443", 1), ("not_allowed", "a.test", 1)]
    lines = denial_summary(evs, most=2)
    assert lines[0] == "6 denials:"
    assert lines[1] == "  3x dns_denied  evil.example:53"
    assert lines[-1] == "  … 2 more in 2 other groups"
    assert denial_summary([]) == []


def test_server_sent_events_decode_as_the_ndjson_lines():
    dec = wire.ExecDecoder()
    got = [dec.event(x["type"], json.dumps(x)) for x in LINES]
    assert [c.data for c in got if c is not None] == ["a\n", "é", "b"]
    assert dec.close().stdout == "a\nb" and dec.close().exit_code == 3
    with pytest.raises(TransportError, match="after its exit"):
        dec.event("stdout", json.dumps(LINES[0]))
    for name, data in (("stdout", "not json"), ("stderr", json.dumps(LINES[0])),
                       ("exit", "[1]")):
        with pytest.raises(TransportError):
            wire.ExecDecoder().event(name, data)
    assert wire.exec_call("s", ["true"], sse=True).sse
    assert not wire.exec_call("s", ["true"]).sse


def _signed(record: dict[str, object]) -> tuple[dict[str, object], object]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from stockade.events.record import sign

    key = Ed25519PrivateKey.generate()
    return sign(record, key), key.public_key()


def test_task_record_verified_unverified_and_tampered(tmp_path):
    import base64

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from stockade.client import RecordInvalid
    from stockade.client.records import task_record

    envelope, pub = _signed({"task_id": "0123456789", "ended_by": "killed", "exit_code": None})
    body = json.dumps(envelope).encode()
    plain = task_record(200, body)
    assert not plain.verified and plain.task_id == "0123456789" and plain.ended_by == "killed"
    pem = pub.public_bytes(serialization.Encoding.PEM,  # type: ignore[attr-defined]
                           serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "signing.pub").write_bytes(pem)
    for key in (pub, pem, str(tmp_path / "signing.pub"), tmp_path / "signing.pub"):
        rec = task_record(200, body, key)  # type: ignore[arg-type]
        assert rec.verified and rec.key_id and rec.record == plain.record
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(RecordInvalid, match="no signature by key"):
        task_record(200, body, other)
    changed = dict(envelope, payload=base64.b64encode(
        b'{"ended_by":"exit","exit_code":0,"task_id":"0123456789"}').decode())
    with pytest.raises(RecordInvalid, match="does not verify"):
        task_record(200, json.dumps(changed).encode(), pub)
    for bad in ({"payloadType": "x", "payload": "", "signatures": []},
                dict(envelope, payload="%%%")):
        with pytest.raises(RecordInvalid):
            task_record(200, json.dumps(bad).encode())
    for key in (tmp_path / "missing.pub", b"not pem"):
        with pytest.raises(BadRequest) as e:
            task_record(200, body, key)
        assert e.value.field == "public_key"
    with pytest.raises(StockadeError) as refused:
        task_record(409, b'{"error": "session_running", "detail": "runs"}')
    assert refused.value.code == "session_running"

"""The pure parts of sessions: the streaming scrubber, the session table's TTL rules,
path and label checks, the request models and the committed OpenAPI document."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from pydantic import ValidationError
from stockade.launcher import files, openapi, scrub
from stockade.launcher.execrun import StreamText
from stockade.launcher.session_api import ExecRequest, SessionCreate, field_of
from stockade.launcher.sessions import SessionTable, extend, new_row

from stockade.tasks.labels import LabelError, check_labels

ROOT = Path(__file__).resolve().parents[2]
SCRUBBER = scrub.build(host_paths=["/var/lib/stockade/sandboxes/abc"],
                       host_env={"SECRET_TOKEN": "tok-123456789"},
                       hostnames=["buildhost"], addresses=["10.213.4.1"])


def _chunked(data: bytes, cuts: list[int], cap: int = 1 << 20) -> tuple[str, StreamText]:
    t = StreamText(SCRUBBER, cap)
    out, last = [], 0
    for c in sorted(set(cuts)):
        out.append(t.feed(data[last:c]))
        last = c
    out.append(t.feed(data[last:]))
    out.append(t.end())
    return "".join(out), t


def test_secret_split_across_chunks() -> None:
    data = b"key tok-123456789 at /var/lib/stockade/sandboxes/abc/x on buildhost 10.213.4.1\n"
    for cut in range(1, len(data)):
        text, _ = _chunked(data, [cut])
        assert text == scrub.scrub(data.decode(), SCRUBBER), cut
        assert "tok-123" not in text and "10.213.4.1" not in text


def test_ordinary_output_is_not_held_back() -> None:
    t = StreamText(SCRUBBER, 1 << 20)
    assert t.feed(b"first\n") == "first\n"
    # a tail that may become a literal waits; the rest of the line passes
    assert t.feed(b"x /var/li") == "x "
    assert t.feed(b"b/stockade/sandboxes/abc!") + t.end() == "<host-path>!"


def test_address_inside_a_longer_number_survives() -> None:
    text, _ = _chunked(b"10.213.4.12 and 10.213.4.1\n", [9])
    assert text == "10.213.4.12 and <infra-address>\n"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["tok-123456789", "10.213.4.1", "BuildHost", "/var/lib/",
                                 "stockade/sandboxes/abc", " ", "7", "\n", "é", "x"]),
                max_size=20),
       st.lists(st.integers(min_value=0, max_value=300), max_size=6))
def test_chunked_equals_whole(words: list[str], cuts: list[int]) -> None:
    data = "".join(words).encode()
    text, _ = _chunked(data, [c for c in cuts if c <= len(data)])
    assert text == scrub.scrub(data.decode(), SCRUBBER)


def test_invalid_utf8_and_cap() -> None:
    text, t = _chunked(b"\xffok" + "é".encode() * 10, [4], cap=8)
    assert text.startswith("\ufffdok") and t.truncated and t.kept == 8 and t.total == 23


def test_session_ttl_cap() -> None:
    row = new_row("a" * 10, "p", "container", 100.0, 30, 60, {})
    assert row.expires_at == 130.0 and not row.capped
    extend(row, 50, 120.0)
    assert row.expires_at == 160.0 and row.capped
    capped = new_row("b" * 10, "p", "container", 0.0, 600, 60, {})
    assert capped.expires_at == 60.0 and capped.capped
    table = SessionTable()
    table.add(row)
    assert table.expired(159.0) == [] and table.expired(160.0) == [row.session_id]
    table.ended(row.session_id)
    assert table.expired(1e9) == [] and table.get(row.session_id).view()["state"] == "ended"


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../b", "a/./b", "", "a\0b"])
def test_paths_refused(path: str) -> None:
    with pytest.raises(files.FileError) as e:
        files.check_rel(path)
    assert e.value.code == "path_refused"


def test_labels() -> None:
    assert check_labels({"user": "alice", "run.id": "r-1"}) == {"user": "alice",
                                                                 "run.id": "r-1"}
    for bad in ({"User": "x"}, {"a" * 64: "x"}, {"task_id": "x"}, {"k": "x" * 257},
                {"k": "a\nb"}, {f"k{i}": "v" for i in range(33)}, ["k"]):
        with pytest.raises(LabelError):
            check_labels(bad)


def test_models_name_the_field() -> None:
    with pytest.raises(ValidationError) as e:
        SessionCreate.model_validate({"profile": "p", "inputs": [{"host": "rel",
                                                                  "guest": "/in"}]})
    assert field_of(e.value)[0] == "inputs.0.host"
    with pytest.raises(ValueError, match="exclude"):
        ExecRequest(argv=["true"], stdin="a", stdin_b64="YQ==").stdin_bytes()
    assert ExecRequest(argv=["cat"], stdin_b64="AAE=").stdin_bytes() == b"\0\1"


def test_openapi_is_valid_and_committed() -> None:
    doc = openapi.document()
    validate(doc)
    committed = (ROOT / "docs" / "openapi.json").read_text()
    assert json.loads(committed) == doc, (
        "docs/openapi.json is stale: python -m stockade.launcher.openapi > docs/openapi.json")


@pytest.mark.parametrize("walk", [False, True])
def test_confinement_on_a_real_tree(tmp_path: Path, scratch_tmpfs: Path,
                                    monkeypatch: pytest.MonkeyPatch, walk: bool) -> None:
    """Both resolvers (openat2, and the O_NOFOLLOW walk of kernels without it) refuse
    every symlink on the way and at the target."""
    if walk:
        monkeypatch.setattr(files, "_openat2_works", False)
    root, outside = scratch_tmpfs, tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("host")
    (root / "dirlink").symlink_to(outside)
    (root / "filelink").symlink_to(outside / "f")
    me = files.Owner(os.getuid(), os.getgid())
    assert files.write(str(root), "a/b/c.txt", iter([b"x", b"yz"]), 10, me) == 3
    assert files.read(str(root), "a/b/c.txt", 10) == b"xyz"
    for path in ("dirlink/f", "filelink", "dirlink/new"):
        with pytest.raises(files.FileError) as e:
            files.write(str(root), path, iter([b"evil"]), 10, me)
        assert e.value.code == "path_refused", path
        if path != "dirlink/new":
            with pytest.raises(files.FileError):
                files.read(str(root), path, 10)
    with pytest.raises(files.FileError) as e:
        files.write(str(root), "a/b/c.txt", iter([b"0123456789", b"!"]), 10, me)
    assert e.value.code == "too_large" and files.read(str(root), "a/b/c.txt", 10) == b"xyz"
    assert (outside / "f").read_text() == "host" and [p.name for p in outside.iterdir()] == ["f"]


def test_run_requests_take_labels() -> None:
    from stockade.launcher.run_request import RequestError, parse_run_request, run_request
    from stockade.launcher.spec import SandboxSpec

    spec = SandboxSpec("p", ["true"], labels={"user": "bob"})
    assert parse_run_request(run_request(spec))[0] == spec
    with pytest.raises(RequestError) as e:
        parse_run_request({"profile": "p", "argv": ["true"], "labels": {"task_id": "x"}})
    assert e.value.field == "labels"

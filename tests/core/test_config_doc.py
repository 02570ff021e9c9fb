"""The config reference takes each key's meaning from the comment at the key itself: the
comment on its own line, else the whole comment block right above it. A note above a
field that has its own comment, or the last line of a longer block, must not become the
field's description (gateway.uvloop once read as the upload-cap note)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from stockade import config_doc


class _Sample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    plain: int = 1  # own comment
    # a note about something else
    noted: bool = True  # what noted does
    # first line of a longer description that
    # continues here
    long: str = ""
    # a single line above
    above: int = 2


def test_descriptions_come_from_the_field_itself() -> None:
    found = config_doc._comments(_Sample)
    assert {name: found.get(name) for name in _Sample.model_fields} == {
        "plain": "own comment",
        "noted": "what noted does",
        "long": "first line of a longer description that continues here",
        "above": "a single line above",
    }


def test_gateway_uvloop_is_described_as_uvloop() -> None:
    rows = {key: doc for key, _, doc in config_doc._rows(config_doc.Config, "")}
    assert "uvloop" in rows["gateway.uvloop"]
    assert "egress_bytes" not in rows["gateway.uvloop"]
    assert rows["launcher.rlimit_nofile"].startswith("rlimits of the command")

"""The gateway -> inspector control lines (gateway/inspector/control.py), pure."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.gateway.inspector.control import MAX_LINE, ControlLines, end_task_line

ids = st.text(min_size=1, max_size=64)


@given(st.lists(ids, max_size=20), st.data())
@settings(max_examples=200)
def test_end_task_lines_round_trip_however_the_pipe_splits_them(
    tasks: list[str], data: st.DataObject
) -> None:
    stream = b"".join(end_task_line(t) for t in tasks)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    lines, out, prev = ControlLines(), [], 0
    for cut in [*cuts, len(stream)]:
        out += lines.feed(stream[prev:cut])
        prev = cut
    assert out == tasks and lines.bad == 0


def test_bad_and_over_long_lines_are_skipped_and_counted() -> None:
    lines = ControlLines()
    junk = b'not json\n["end_task"]\n{"end_task": 5}\n{"end_task": ""}\n{"other": "x"}\n'
    assert lines.feed(junk) == []
    assert lines.bad == 5
    # an over-long line, fed in pieces, is dropped up to its newline; the next one counts
    assert lines.feed(b"x" * (MAX_LINE + 1)) == []
    assert lines.feed(b'{"end_task": "t-1"}') == []
    assert lines.feed(b"\n" + end_task_line("t-2")) == ["t-2"]
    assert lines.bad == 6


@given(st.binary(max_size=4 * MAX_LINE))
def test_any_bytes_never_raise(data: bytes) -> None:
    lines = ControlLines()
    for task_id in lines.feed(data) + lines.feed(b"\n"):
        assert isinstance(task_id, str) and task_id

"""The guest agent's framing (`vmchannel`, pure; fuzzed with hypothesis) and the host's end of
the link (`vmexec.AgentLink`) against a peer that plays a guest over a real socket pair:
frames route to their execs, and a guest that breaks the framing ends every exec."""

from __future__ import annotations

import marshal
import socket
import subprocess
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stockade.launcher import LauncherError
from stockade.launcher import vmchannel as ch
from stockade.launcher.execspec import ExecSpec
from stockade.launcher.vmexec import ENDED_WITH_VM, AgentLink, exec_payload

frames = st.lists(st.tuples(st.integers(0, ch.MAX_CHANNEL), st.sampled_from(sorted(ch.GUEST_TYPES)),
                            st.binary(max_size=3000)), max_size=12)


@given(frames, st.lists(st.integers(1, 4000), max_size=30))
def test_frames_survive_any_split(fs: list[tuple[int, int, bytes]], cuts: list[int]) -> None:
    wire = b"".join(ch.encode(c, k, p) for c, k, p in fs)
    dec = ch.Decoder(ch.GUEST_TYPES)
    got, i = [], 0
    for n in [*cuts, len(wire)]:
        got += dec.feed(wire[i:i + n])
        i += n
    assert got == fs and dec.pending() == 0


@given(st.binary(max_size=2000))
def test_any_bytes_give_frames_or_a_channel_error(data: bytes) -> None:
    dec = ch.Decoder(ch.HOST_TYPES)
    try:
        out = dec.feed(data)
    except ch.ChannelError:
        assert dec.broken
        with pytest.raises(ch.ChannelError):
            dec.feed(b"")  # no resync on a stream whose framing is lost
        return
    assert all(k in ch.HOST_TYPES and len(p) <= ch.MAX_PAYLOAD for _, k, p in out)


def test_bad_frames_are_refused() -> None:
    over = (ch.MAX_PAYLOAD + 1).to_bytes(4, "big") + (1).to_bytes(4, "big") + bytes([ch.STDOUT])
    with pytest.raises(ch.ChannelError):
        ch.Decoder(ch.GUEST_TYPES).feed(over)  # refused from its header, before the payload
    with pytest.raises(ch.ChannelError):  # a host-only type from the guest
        ch.Decoder(ch.GUEST_TYPES).feed(ch.encode(1, ch.EXEC, b"x"))
    for args in [(-1, ch.EXIT), (ch.MAX_CHANNEL + 1, ch.EXIT), (1, 99)]:
        with pytest.raises(ValueError):
            ch.encode(*args)
    with pytest.raises(ValueError):
        ch.encode(1, ch.STDOUT, b"x" * (ch.MAX_PAYLOAD + 1))
    assert [len(f) for f in ch.chunks(3, ch.STDIN, b"y" * (ch.CHUNK + 1))] == [
        ch.HEADER + ch.CHUNK, ch.HEADER + 1]


@given(st.binary(max_size=40))
def test_exit_payloads_parse_or_are_refused(payload: bytes) -> None:
    try:
        rc, ooms, pids = ch.parse_exit(payload)
    except ch.ChannelError:
        return
    assert 0 <= rc <= 255 and ooms >= 0 and pids >= 0
    assert ch.parse_exit(ch.exit_text(rc, ooms, pids)) == (rc, ooms, pids)


def test_exec_requests_are_checked_before_they_leave() -> None:
    payload = exec_payload(ExecSpec(("ls", "-l"), {"A": "1"}, "/scratch/x/../y"))
    req = marshal.loads(payload)  # noqa: S302 - the payload built just above
    assert req == {"argv": ["ls", "-l"], "env": {"A": "1"}, "cwd": "/scratch/y", "stdin": False}
    for bad in [ExecSpec(()), ExecSpec(("a\0b",)), ExecSpec(("ls",), cwd="/scratch/../etc"),
                ExecSpec(("ls",), cwd="/scratchy"), ExecSpec(("ls",), {"A=B": "1"}),
                ExecSpec(("x" * ch.MAX_PAYLOAD,))]:
        with pytest.raises(LauncherError):
            exec_payload(bad)


class Guest:
    """The far end of the link: reads the host's frames, answers what a test tells it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.dec = ch.Decoder(ch.HOST_TYPES)

    def frames(self, n: int) -> list[tuple[int, int, bytes]]:
        got: list[tuple[int, int, bytes]] = []
        while len(got) < n:
            got += self.dec.feed(self.sock.recv(65536))
        return got

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))


def link_pair() -> tuple[AgentLink, Guest]:
    a, b = socket.socketpair()
    link = AgentLink(a)
    link.start()
    return link, Guest(b)


def test_frames_route_to_their_execs() -> None:
    link, guest = link_pair()
    with pytest.raises(LauncherError, match="not ready"):
        link.exec(ExecSpec(("true",)))
    guest.send(ch.encode(0, ch.READY, b"exec"))
    link.wait_ready(10, lambda: True)
    p1 = link.exec(ExecSpec(("a",), stdin=b"in"))
    p2 = link.exec(ExecSpec(("b",)))
    got = guest.frames(4)  # p1's EXEC, its stdin and EOF; p2's EXEC
    assert [(c, k) for c, k, _ in got] == [(1, ch.EXEC), (1, ch.STDIN), (1, ch.STDIN),
                                           (2, ch.EXEC)]
    assert [p for _, _, p in got[1:3]] == [b"in", b""]
    p2.send_signal(15)
    assert guest.frames(1) == [(2, ch.SIGNAL, b"15")]
    guest.send(ch.encode(2, ch.STDOUT, b"two"), ch.encode(1, ch.STDERR, b"one"),
               ch.encode(1, ch.EXIT, b"3 0 0"), ch.encode(2, ch.ERROR, b"cwd refused"),
               ch.encode(9, ch.STDOUT, b"nobody's"))
    assert (p1.wait(10), p1.stderr.read(), p1.stdout.read()) == (3, b"one", b"")  # type: ignore[union-attr]
    assert (p2.wait(10), p2.stdout.read()) == (126, b"two")  # type: ignore[union-attr]
    assert p2.refused == "cwd refused" and b"cwd refused" in p2.stderr.read()  # type: ignore[union-attr]
    assert link.running() == 0
    link.close()
    with pytest.raises(LauncherError):
        link.exec(ExecSpec(("true",)))


def test_a_guest_that_breaks_the_framing_ends_every_exec() -> None:
    link, guest = link_pair()
    guest.send(ch.encode(0, ch.READY, b"exec"))
    link.wait_ready(10, lambda: True)
    procs = [link.exec(ExecSpec(("x",))) for _ in range(3)]
    guest.send(ch.encode(1, ch.EXIT, b"999 0 0"))  # not an exit status
    assert [p.wait(10) for p in procs] == [ENDED_WITH_VM] * 3
    assert link.broken and "bad exit status" in link.broken
    link.close()
    # the guest's end closing (a killed VM) ends what runs too, and wakes a start's wait
    link, guest = link_pair()
    done = threading.Event()

    def waiter() -> None:
        with pytest.raises(LauncherError, match="ended before its agent"):
            link.wait_ready(30, lambda: True)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    guest.sock.close()
    t.join(30)
    assert done.is_set()
    link.close()


def test_a_killed_exec_the_guest_never_ends_is_ended_here() -> None:
    """A hostile guest takes the SIGKILL and never sends the exec's EXIT: the host's wait
    after the kill ends it (ENDED_WITH_VM), its pipes reach EOF (its pump threads have
    closed them), the link forgets it and a late EXIT is dropped. An exec that was not
    killed still just times out."""
    link, guest = link_pair()
    guest.send(ch.encode(0, ch.READY, b"exec"))
    link.wait_ready(10, lambda: True)
    quiet, silent = link.exec(ExecSpec(("q",))), link.exec(ExecSpec(("s",)))
    guest.frames(2)
    with pytest.raises(subprocess.TimeoutExpired):
        quiet.wait(0.05)
    silent.kill()
    assert guest.frames(1) == [(2, ch.SIGNAL, b"9")]
    assert silent.wait(0.05) == ENDED_WITH_VM and silent.poll() == ENDED_WITH_VM
    assert silent.stdout.read() == b"" and silent.stderr.read() == b""  # type: ignore[union-attr]
    assert link.running() == 1  # `quiet` only
    guest.send(ch.encode(2, ch.EXIT, b"0 0 0"), ch.encode(1, ch.EXIT, b"4 0 0"))
    assert quiet.wait(10) == 4 and silent.returncode == ENDED_WITH_VM
    assert link.running() == 0 and link.broken is None
    link.close()

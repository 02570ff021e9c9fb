"""The guest agent's framing (`vmchannel`, pure; fuzzed with hypothesis) and the host's end of
the link (`vmexec.AgentLink`) against a peer that plays a guest over a real socket pair:
frames route to their execs, and a guest that breaks the framing, or sends frames for a
channel the host never issued (channels are random: none can be sent ahead), ends every
exec; a forgotten exec's late frames are dropped."""

from __future__ import annotations

import marshal
import socket
import subprocess
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stockade.launcher import LauncherError, vmexec
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


def ready_pair() -> tuple[AgentLink, Guest]:
    """A link whose guest has said READY."""
    link, guest = link_pair()
    guest.send(ch.encode(0, ch.READY, b"exec"))
    link.wait_ready(10, lambda: True)
    return link, guest


def test_frames_route_to_their_execs() -> None:
    link, guest = link_pair()
    with pytest.raises(LauncherError, match="not ready"):
        link.exec(ExecSpec(("true",)))
    guest.send(ch.encode(0, ch.READY, b"exec"))
    link.wait_ready(10, lambda: True)
    p1 = link.exec(ExecSpec(("a",), stdin=b"in"))
    p2 = link.exec(ExecSpec(("b",)))
    c1, c2 = p1.pid, p2.pid
    assert 0 < c1 <= ch.MAX_CHANNEL and 0 < c2 <= ch.MAX_CHANNEL and c1 != c2
    got = guest.frames(4)  # p1's EXEC, its stdin and EOF; p2's EXEC
    assert [(c, k) for c, k, _ in got] == [(c1, ch.EXEC), (c1, ch.STDIN), (c1, ch.STDIN),
                                           (c2, ch.EXEC)]
    assert [p for _, _, p in got[1:3]] == [b"in", b""]
    p2.send_signal(15)
    assert guest.frames(1) == [(c2, ch.SIGNAL, b"15")]
    guest.send(ch.encode(c2, ch.STDOUT, b"two"), ch.encode(c1, ch.STDERR, b"one"),
               ch.encode(c1, ch.EXIT, b"3 0 0"), ch.encode(c2, ch.ERROR, b"cwd refused"),
               ch.encode(c1, ch.STDOUT, b"after its end"))  # an ended exec's: dropped
    assert (p1.wait(10), p1.stderr.read(), p1.stdout.read()) == (3, b"one", b"")  # type: ignore[union-attr]
    assert (p2.wait(10), p2.stdout.read()) == (126, b"two")  # type: ignore[union-attr]
    assert p2.refused == "cwd refused" and b"cwd refused" in p2.stderr.read()  # type: ignore[union-attr]
    assert link.running() == 0 and link.broken is None
    link.close()
    with pytest.raises(LauncherError):
        link.exec(ExecSpec(("true",)))


def test_a_guest_that_breaks_the_framing_ends_every_exec() -> None:
    link, guest = ready_pair()
    procs = [link.exec(ExecSpec(("x",))) for _ in range(3)]
    guest.send(ch.encode(procs[0].pid, ch.EXIT, b"999 0 0"))  # not an exit status
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
    link, guest = ready_pair()
    quiet, silent = link.exec(ExecSpec(("q",))), link.exec(ExecSpec(("s",)))
    guest.frames(2)
    with pytest.raises(subprocess.TimeoutExpired):
        quiet.wait(0.05)
    silent.kill()
    assert guest.frames(1) == [(silent.pid, ch.SIGNAL, b"9")]
    assert silent.wait(0.05) == ENDED_WITH_VM and silent.poll() == ENDED_WITH_VM
    assert silent.stdout.read() == b"" and silent.stderr.read() == b""  # type: ignore[union-attr]
    assert link.running() == 1  # `quiet` only
    # its late output, refusal and exit are dropped: it was issued (no breach)
    guest.send(ch.encode(silent.pid, ch.STDOUT, b"late"), ch.encode(silent.pid, ch.ERROR, b"x"),
               ch.encode(silent.pid, ch.EXIT, b"0 0 0"), ch.encode(quiet.pid, ch.EXIT, b"4 0 0"))
    assert quiet.wait(10) == 4 and silent.returncode == ENDED_WITH_VM
    assert link.running() == 0 and link.broken is None
    link.close()


def test_frames_sent_ahead_for_a_channel_never_issued_end_the_link() -> None:
    """A guest whose kernel fell sends output and an exit for the channels it expects next
    (the old numbering's 1, 2, ... and one past the running exec's): with sequential
    numbers they would land in the next exec once the host registers it. Channels are
    random, and the first frame for one never issued ends the link and every exec on it."""
    link, guest = ready_pair()
    running = link.exec(ExecSpec(("r",)))
    guest.frames(1)
    for chan in (1, 2, running.pid + 1):
        if chan != running.pid:
            guest.send(ch.encode(chan, ch.STDOUT, b"forged\n"), ch.encode(chan, ch.EXIT, b"0 0 0"))
    assert link.ended.wait(10)
    assert running.wait(10) == ENDED_WITH_VM and running.stdout.read() == b""  # type: ignore[union-attr]
    assert link.broken is not None and "never issued" in link.broken
    with pytest.raises(LauncherError, match="has ended"):
        link.exec(ExecSpec(("next",)))
    link.close()


def test_channels_are_random_non_zero_and_unique(monkeypatch: pytest.MonkeyPatch) -> None:
    """A channel is never 0, never a live exec's nor a remembered one's; the memory of
    issued channels is bounded (RECENT_CHANNELS): a frame for one issued past it is taken
    for a breach (fails closed), one for a remembered one is dropped."""
    draws = iter([0, 7, 7, 9, 7, 11, 12, 13, 7])
    monkeypatch.setattr(vmexec.secrets, "randbits", lambda n: next(draws))
    monkeypatch.setattr(vmexec, "RECENT_CHANNELS", 4)
    link, guest = ready_pair()
    first = link.exec(ExecSpec(("a",)))
    second = link.exec(ExecSpec(("b",)))  # 0 and a second 7 are drawn again
    assert (first.pid, second.pid) == (7, 9)
    guest.send(ch.encode(7, ch.EXIT, b"0 0 0"))
    assert first.wait(10) == 0
    assert link.exec(ExecSpec(("c",))).pid == 11  # 7 ended, but is remembered
    ended = [link.exec(ExecSpec((str(i),))) for i in range(2)]  # 12, 13: 7 is forgotten
    assert [p.pid for p in ended] == [12, 13]
    assert link.exec(ExecSpec(("d",))).pid == 7
    guest.send(ch.encode(12, ch.EXIT, b"0 0 0"), ch.encode(12, ch.STDOUT, b"late"))
    assert ended[0].wait(10) == 0 and link.broken is None
    guest.send(ch.encode(9, ch.STDOUT, b"past the memory"))  # live: still routed
    guest.send(ch.encode(9, ch.EXIT, b"0 0 0"))
    assert (second.wait(10), second.stdout.read()) == (0, b"past the memory")  # type: ignore[union-attr]
    guest.send(ch.encode(8, ch.STDOUT, b"never issued"))
    assert link.ended.wait(10) and "never issued" in (link.broken or "")
    link.close()


def test_real_channels_are_32_bit_spread_and_unique() -> None:
    link, guest = ready_pair()
    chans = set()
    for _ in range(300):
        chans.add(link.exec(ExecSpec(("x",))).pid)
        guest.frames(1)  # its EXEC: the socket's buffer never fills
    assert len(chans) == 300 and all(0 < c <= ch.MAX_CHANNEL for c in chans)
    assert max(chans) > 1 << 24  # not 1, 2, 3, ...: any chance of that is 2**-2400
    link.close()

from hypothesis import given
from hypothesis import strategies as st

from stockade.netstat import listen_drops, listen_drops_of

TEXT = ("TcpExt: SyncookiesSent ListenOverflows ListenDrops\nTcpExt: 0 17 19\n"
        "IpExt: InNoRoutes\nIpExt: 3\n")


def test_listen_drops_is_read_from_the_tcpext_rows() -> None:
    assert listen_drops_of(TEXT) == 19
    assert listen_drops_of("IpExt: A\nIpExt: 1\n") is None
    assert listen_drops_of("TcpExt: ListenDrops\nTcpExt: x\n") is None
    assert listen_drops_of("TcpExt: ListenDrops Other\nTcpExt: 4\n") is None  # torn row


def test_this_hosts_namespace_shows_it() -> None:
    assert isinstance(listen_drops(), int)


@given(st.text())
def test_any_text_is_a_count_or_none(text: str) -> None:
    got = listen_drops_of(text)
    assert got is None or isinstance(got, int)

"""The host's cost of one hop between two processes: a loopback TCP ping-pong.

A proxy adds hops to every connection (client -> proxy -> upstream and back), and each
hop is a wake-up of another process. Where the two run on different CPUs the wake-up is
an inter-processor interrupt, which on some virtual machines costs tens of microseconds
(seen here: ~65 us one way across the two vCPUs, ~7 us on one CPU). The benches print
this beside their latency columns so a reader can tell a slow proxy from a slow host.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

ROUNDS = 2000


def round_trip_us(cpu_a: int, cpu_b: int, rounds: int = ROUNDS) -> float:
    """Median microseconds of a 1-byte request/answer between two processes pinned to
    `cpu_a` (the asker) and `cpu_b` (the answerer)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the answerer: echo until the asker closes
        try:
            os.sched_setaffinity(0, {cpu_b})
            peer = socket.create_connection(("127.0.0.1", port))
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while peer.recv(16):
                peer.send(b"y")
        finally:
            os._exit(0)
    try:
        saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu_a})
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            conn.send(b"x")
            conn.recv(16)
            samples.append(time.perf_counter() - t0)
        conn.close()
        return statistics.median(samples) * 1e6
    finally:
        listener.close()
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, saved)


def describe() -> str:
    """One line for a bench's output: the same-CPU and cross-CPU round trips."""
    cpus = sorted(os.sched_getaffinity(0))
    same = round_trip_us(cpus[0], cpus[0])
    if len(cpus) < 2:
        return f"host: loopback round trip between two processes {same:.0f} us (one CPU)"
    cross = round_trip_us(cpus[0], cpus[1])
    return (
        f"host: loopback round trip between two processes {same:.0f} us on one CPU, "
        f"{cross:.0f} us across two (each hop a proxy adds costs up to half of the latter)"
    )


if __name__ == "__main__":
    print(describe())

"""CPU per event: build (`make_event`) + write (`EventWriter.write`), old vs current.

The shapes are the ones on hot paths: the gateway's `connection_decision` and
`connection_close` per connection (gateway/conn_events.py `decision_event`,
`close_event`) and the broker's `broker_call` audit event per call (broker/audit.py
`audit_event`). "old" is the implementation before the events speed-up (recursive
`_drop_empty` pass, `json.dumps` per event), copied below so that both run side by side,
in interleaved rounds, in one process; the current one is `stockade.events`. Both write
to a real file (O_APPEND, one write(2) per line), in a temporary directory.

CPU is this thread's CPU time (`time.thread_time_ns`) over `--events` events per round;
the table shows the median over `--rounds` rounds in microseconds per event. Before
timing, the script checks that current writes, for each shape, the old lines upgraded to
schema 2.0 (`upgrade_v2`: ECS fields added and moved; same fixed timestamp) byte for byte,
and prints each shape's line size in both schemas (what the ECS fields cost per line).

    .venv/bin/python bench/events_bench.py [--events 5000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stockade.events import EventWriter, make_event

# --- the old implementation: the test oracle (tests/core/events_oracle.py) -------------

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "core"))
from events_oracle import old_line, old_make_event, upgrade_v2


class OldWriter(EventWriter):
    """`EventWriter.write` with the line encoder it had before the speed-up (the write
    path itself did not change)."""

    encode = staticmethod(old_line)


# --- the shapes, with the arguments their callers pass ------------------------------


def decision_kw(i: int, now: float | None) -> dict[str, Any]:
    """gateway/conn_events.py `decision_event`, an allowed transparent TLS flow."""
    return dict(
        component="gateway",
        action="connection_decision",
        decision="allowed",
        reason="allowed_by_rule",
        task_id="task-7f3a9c",
        profile="pypi-build",
        policy_version="3f9e2a1c",
        rule_id="pypi",
        report_only=False,
        source_ip="10.213.0.2",
        source_port=40000 + i % 20000,
        destination_domain="files.pythonhosted.org",
        destination_ip="151.101.64.223",
        destination_port=443,
        transport="tcp",
        protocol="tls",
        message=None,
        extra={
            "listener": "transparent",
            "connection_id": i,
            "original_destination": "151.101.64.223:443",
        },
        now=now,
    )


def close_kw(i: int, now: float | None) -> dict[str, Any]:
    """gateway/conn_events.py `close_event`, a normal close."""
    return dict(
        component="gateway",
        action="connection_close",
        decision=None,
        reason="closed",
        task_id="task-7f3a9c",
        profile="pypi-build",
        policy_version="3f9e2a1c",
        rule_id="pypi",
        source_ip="10.213.0.2",
        source_port=40000 + i % 20000,
        destination_domain="files.pythonhosted.org",
        destination_ip="151.101.64.223",
        destination_port=443,
        transport="tcp",
        protocol="tls",
        extra={
            "bytes_up": 1834,
            "bytes_down": 4_718_592 + i,
            "duration_s": 0.412345,
            "connection_id": i,
        },
        now=now,
    )


def broker_kw(i: int, now: float | None) -> dict[str, Any]:
    """broker/audit.py `audit_event`: the `broker_call` event (extra already without None)."""
    extra = {
        "api": "github",
        "status": 200,
        "bytes_up": 0,
        "bytes_down": 5321 + i % 100,
        "latency_ms": 12.345,
    }
    return dict(
        component="broker",
        action="broker_call",
        decision="allowed",
        reason="allowed_by_rule",
        task_id="task-7f3a9c",
        profile="pypi-build",
        policy_version="3f9e2a1c",
        source_ip="10.213.0.2",
        destination_domain="api.github.com",
        destination_port=443,
        transport="tcp",
        protocol="http",
        http_method="GET",
        http_status=200,
        url={"path": "/repos/acme/widgets/pulls?state=open"},
        extra={k: v for k, v in extra.items() if v is not None},
        now=now,
    )


SHAPES: dict[str, Callable[[int, float | None], dict[str, Any]]] = {
    "gateway decision": decision_kw,
    "gateway close": close_kw,
    "broker audit": broker_kw,
}


def check_same(tmp: Path) -> None:
    """Current must write the old events upgraded to schema 2.0 (fixed timestamp)."""
    now = 1_790_000_000.123456
    for name, kw in SHAPES.items():
        old_w, new_w = OldWriter(tmp / "old.jsonl"), EventWriter(tmp / "new.jsonl")
        v1 = len(old_line(old_make_event(**kw(0, now))))
        print(f"{name}: {v1} bytes per line in schema 1.0, "
              f"{len(old_line(make_event(**kw(0, now))))} in 2.0")
        for i in range(3):
            old_w.write(upgrade_v2(old_make_event(**kw(i, now)), kw(i, now)))
            new_w.write(make_event(**kw(i, now)))
        old_w.close()
        new_w.close()
        a, b = (tmp / "old.jsonl").read_bytes(), (tmp / "new.jsonl").read_bytes()
        if a != b:
            sys.exit(f"{name}: old and current output differ:\n{a!r}\n{b!r}")
        (tmp / "old.jsonl").unlink()
        (tmp / "new.jsonl").unlink()


def run_round(
    build: Callable[..., dict[str, Any]],
    writer: EventWriter,
    kw: Callable[[int, float | None], dict[str, Any]],
    n: int,
) -> float:
    """CPU microseconds per event for n events (argument dicts built beforehand)."""
    args = [kw(i, None) for i in range(n)]
    write = writer.write
    t0 = time.thread_time_ns()
    for a in args:
        write(build(**a))
    return (time.thread_time_ns() - t0) / n / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=5000, help="events per round")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="events-bench-") as d:
        tmp = Path(d)
        check_same(tmp)
        # big max_bytes: rotation cost is not what this measures (and is unchanged)
        old_w = OldWriter(tmp / "old.jsonl", max_bytes=2**40)
        new_w = EventWriter(tmp / "new.jsonl", max_bytes=2**40)
        res: dict[str, dict[str, list[float]]] = {s: {"old": [], "new": []} for s in SHAPES}
        for r in range(args.rounds):
            for name, kw in SHAPES.items():
                # alternate which goes first so drift hits both alike
                order = [("old", old_make_event, old_w), ("new", make_event, new_w)]
                for label, build, w in order if r % 2 == 0 else order[::-1]:
                    res[name][label].append(run_round(build, w, kw, args.events))
        old_w.close()
        new_w.close()
    print(f"CPU per event (make_event + write), median of {args.rounds} rounds "
          f"x {args.events} events, microseconds")
    print(f"{'shape':<18} {'old':>8} {'current':>8} {'ratio':>7}")
    for name, r in res.items():
        o, n = statistics.median(r["old"]), statistics.median(r["new"])
        print(f"{name:<18} {o:8.2f} {n:8.2f} {n / o:7.2f}")


if __name__ == "__main__":
    main()

"""The gateway's per-connection tally (`gateway/metrics.py` `ConnTally`) exposes exactly
what prometheus_client's own counters and histogram would for the same updates: the
same metric names, labels, bucket bounds, counts and sums."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from stockade.gateway.metrics import DECISION_BUCKETS, ConnTally, GatewayMetrics

KEYS = st.tuples(st.sampled_from(["allowed", "denied"]),
                 st.sampled_from(["allowed", "not_allowlisted", "sni_mismatch"]),
                 st.sampled_from(["", "web", "build"]))
SECONDS = st.one_of(st.sampled_from(DECISION_BUCKETS), st.floats(0, 30, allow_nan=False))


def _samples(text: bytes) -> set[str]:
    # `_created` samples are the client's own bookkeeping (time of the first update)
    return {line for line in text.decode().splitlines()
            if line and not line.startswith("#") and "_created" not in line}


def _reference(keys: list[tuple[str, str, str]], seconds: list[float],
               moved: list[tuple[int, int]]) -> bytes:
    r = CollectorRegistry()
    d = Counter("stockade_gateway_decisions", "Connection decisions",
                ["outcome", "reason", "profile"], registry=r)
    b = Counter("stockade_gateway_bytes", "Bytes relayed", ["direction"], registry=r)
    h = Histogram("stockade_gateway_decision_seconds", "x", buckets=DECISION_BUCKETS,
                  registry=r)
    b.labels("up")
    b.labels("down")
    for k in keys:
        d.labels(*k).inc()
    for s in seconds:
        h.observe(s)
    for up, down in moved:
        b.labels("up").inc(up)
        b.labels("down").inc(down)
    return generate_latest(r)


@given(st.lists(KEYS, max_size=20), st.lists(SECONDS, max_size=20),
       st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), max_size=5))
def test_the_tally_renders_as_prometheus_client_would(
        keys: list[tuple[str, str, str]], seconds: list[float],
        moved: list[tuple[int, int]]) -> None:
    r = CollectorRegistry()
    tally = ConnTally()
    r.register(tally)
    for k in keys:
        tally.decided(*k)
    for s in seconds:
        tally.timed(s)
    for up, down in moved:
        tally.relayed(up, down)
    assert _samples(generate_latest(r)) == _samples(_reference(keys, seconds, moved))


def test_the_gateways_metrics_page_has_the_tally() -> None:
    m = GatewayMetrics()
    m.tally.decided("denied", "not_allowlisted", "web")
    m.tally.timed(0.003)
    text = m.render().decode()
    assert 'stockade_gateway_decisions_total{outcome="denied",profile="web",' \
           'reason="not_allowlisted"} 1.0' in text
    assert 'stockade_gateway_decision_seconds_bucket{le="0.005"} 1.0' in text
    assert 'stockade_gateway_decision_seconds_bucket{le="0.0025"} 0.0' in text
    assert 'stockade_gateway_bytes_total{direction="up"} 0.0' in text

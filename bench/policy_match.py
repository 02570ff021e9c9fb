"""How decide()/decide_name() scale with rule count: indexed vs a naive linear scan.

Builds profiles of 10 / 1,000 / 10,000 entries (exact names, `*.` wildcards, CIDRs) in a
temporary rules directory, loads them with the real loader and times single decisions.
Prints one table; the target is a median <= 5 µs at 10,000 entries. No network.

    .venv/bin/python bench/policy_match.py [--rounds N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stockade.policy import RequestFacts, decide, decide_name, load_rules
from stockade.policy.hosts import normalize_host
from stockade.policy.lint import pattern_covers


def write_profile(root: Path, n: int) -> None:
    (root / "profiles").mkdir(parents=True)
    lines = ["profile: big", "egress:", "  allow:"]
    for i in range(n):
        kind = i % 10
        if kind < 6:
            lines.append(f"    - {{host: h{i}.svc{i % 97}.example.com, reason: bench}}")
        elif kind < 9:
            lines.append(f"    - {{host: '*.w{i}.example.net', reason: bench}}")
        else:
            a, b = (i // 256) % 256, i % 256
            lines.append(f"    - {{cidr: 10.{a}.{b}.0/24, reason: bench, ports: [5432]}}")
    lines += ["  deny:", "    - {host: blocked.example.com, reason: bench}"]
    (root / "profiles" / "big.yaml").write_text("\n".join(lines) + "\n")


def per_call_us(fn: Callable[[], object], rounds: int, batch: int = 20) -> tuple[float, float]:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - t0) / batch / 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def naive_decide(entries: list, host: str) -> bool:  # type: ignore[type-arg]
    """The linear scan a regex/list matcher would do (for comparison only)."""
    name = normalize_host(host)
    return any(e.host is not None and (pattern_covers(e.host, name)) for e in entries)


def measure(n: int, rounds: int, rng: random.Random) -> list[tuple[int, str, float, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rules"
        write_profile(root, n)
        t0 = time.perf_counter()
        rs = load_rules(root)
        load_ms = (time.perf_counter() - t0) * 1000
    entries = list(rs.profiles["big"].allow)
    exact = [e.host for e in entries if e.host and not e.host.startswith("*.")]
    wild = [e.host[2:] for e in entries if e.host and e.host.startswith("*.")]
    hit_exact = rng.choice(exact)
    hit_wild = "a.b." + rng.choice(wild) if wild else hit_exact
    # facts are built once: the gateway builds them while parsing; decide() is what is timed
    f_exact = RequestFacts(host=hit_exact)
    f_wild = RequestFacts(host=hit_wild)
    f_miss = RequestFacts(host="nope.example.org")
    f_deny = RequestFacts(host="blocked.example.com")
    f_cidr = RequestFacts(ip="10.0.9.7", port=5432)
    fresh_n = 50_000
    fresh = iter([RequestFacts(host=f"n{i}.fresh{n}.example.org") for i in range(fresh_n)])
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("exact hit", lambda: decide(rs, "big", f_exact), rounds),
        ("wildcard hit", lambda: decide(rs, "big", f_wild), rounds),
        ("miss", lambda: decide(rs, "big", f_miss), rounds),
        ("deny", lambda: decide(rs, "big", f_deny), rounds),
        ("cidr hit", lambda: decide(rs, "big", f_cidr), rounds),
        ("dns name", lambda: decide_name(rs, "big", hit_exact), rounds),
        # a name never seen before on every call: no normalisation cache hit
        ("miss, new names", lambda: decide(rs, "big", next(fresh)), min(rounds, fresh_n // 20)),
        ("naive scan (miss)", lambda: naive_decide(entries, "nope.example.org"),
         max(20, rounds // 50)),
    ]  # fmt: skip
    rows = []
    for label, fn, r in cases:
        med, p99 = per_call_us(fn, r)
        rows.append((n, label, med, p99, load_ms))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(7)
    rows = [row for n in (10, 1_000, 10_000) for row in measure(n, args.rounds, rng)]
    print(f"{'entries':>8}  {'case':<18} {'median µs':>10} {'p99 µs':>10} {'load ms':>9}")
    for n, label, med, p99, load_ms in rows:
        print(f"{n:>8}  {label:<18} {med:>10.2f} {p99:>10.2f} {load_ms:>9.0f}")
    indexed = [r for r in rows if r[0] == 10_000 and not r[1].startswith("naive")]
    worst = max(indexed, key=lambda r: r[2])
    print(f"\nworst indexed median at 10,000 entries: {worst[2]:.2f} µs ({worst[1]}); "
          f"target <= 5 µs: {'OK' if worst[2] <= 5 else 'OVER'}")  # fmt: skip


if __name__ == "__main__":
    main()

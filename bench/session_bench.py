"""Sessions against one-shot runs, side by side in one run (root).

Per tier (container, gVisor): the round trip of `true` in a warm session through the
control API (POST .../exec over the Unix socket, stream: false) as p50/p99; the same
through `Launcher.exec` in-process (what the API adds is the difference); session create
to ready (POST /v1/sessions until its 201); and a one-shot run of `true` through
`POST /v1/sandboxes`, the cost a session saves per command. One service, one launcher.
On the container tier floors run interleaved with the execs, on the same session:
`nsenter --all true` into its init's namespaces (entering a sandbox and nothing else) and
the steps of a `podman exec` / `runc exec` done by util-linux (nsenter, a pid namespace of
its own, setpriv to the sandbox uid with no capabilities and no_new_privs; no seccomp),
outside and (through a `sh` that joins them first) inside the sandbox's cgroups.
`--concurrent N`: N sessions created at once, one exec in each at once (each prints its
network namespace: all must differ), all killed, then what is left on the host (netns,
links, nft set elements, cgroups, scratch) is listed.

    .venv/bin/python bench/session_bench.py [--tiers container,gvisor] [--execs 200]
        [--runs 10] [--sessions 10] [--concurrent 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from launcher_rig import bench_config, stand_ins
from stockade.launcher import netns, nft
from stockade.launcher.cgroups import leftover_names
from stockade.launcher.execspec import ExecSpec
from stockade.launcher.service import LauncherService

from stockade.tasks.client import _UnixHTTPConnection

PROFILE = """\
profile: {name}
description: session bench
isolation: {tier}
limits: {{cpus: 1, memory: 128MiB, disk: 16MiB, pids: 64, ttl: 600s}}
selftest: sampled
egress:
  mode: enforce
"""


CLEAN_WAIT_S = 300.0  # the teardowns of --concurrent's sessions, on a loaded host


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def _call(sock: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    conn = _UnixHTTPConnection(sock, 300)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else None
    finally:
        conn.close()


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _floors(svc: LauncherService, sid: str) -> list[tuple[str, list[str]]]:
    """The container tier's floors on session `sid`: argv run from the bench's process."""
    rec = svc.launcher.state.read()[sid]
    # the init is the one child of `unshare --fork` (the record's outermost process)
    init = Path(f"/proc/{rec.pid}/task/{rec.pid}/children").read_text().split()[0]
    s = svc.launcher.s
    enter = ["nsenter", "--target", init, "--all"]
    like = [*enter, "unshare", "--pid", "--fork", "--kill-child", "setpriv",
            f"--reuid={s.sandbox_uid}", f"--regid={s.sandbox_gid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "true"]
    # as an exec must (and podman exec does): into the sandbox's cgroups first, whose CPU
    # weight (launcher.cgroup_cpu_weight) is below the host's services' under contention
    join = " ".join(f"echo $$ > {shlex.quote(d)}/cgroup.procs;" for d in rec.cgroups)
    return [("nsenter true", [*enter, "true"]), ("exec-like floor", like),
            ("exec-like floor in the sandbox's cgroups",
             ["sh", "-c", f'{join} exec "$@"', "floor", *like])]


def _tier(svc: LauncherService, sock: str, tier: str, a: argparse.Namespace) -> dict[str, Any]:
    creates, api, direct, oneshot = [], [], [], []
    sids = []
    for _ in range(a.sessions):
        t0 = time.perf_counter()
        status, s = _call(sock, "POST", "/v1/sessions", {"profile": tier})
        assert status == 201, s
        creates.append(_ms(t0))
        sids.append(s["session_id"])
    sid = sids[0]
    for _ in range(5):  # warm: the seccomp filter, runsc's caches
        _call(sock, "POST", f"/v1/sessions/{sid}/exec", {"argv": ["true"], "stream": False})
    floors = _floors(svc, sid) if tier == "container" else []
    floor_ms: dict[str, list[float]] = {name: [] for name, _ in floors}
    for _ in range(a.execs):  # interleaved: each sees the same load
        t0 = time.perf_counter()
        status, r = _call(sock, "POST", f"/v1/sessions/{sid}/exec",
                          {"argv": ["true"], "stream": False})
        api.append(_ms(t0))
        assert status == 200 and r["exit_code"] == 0, r
        t0 = time.perf_counter()
        svc.launcher.exec(sid, ExecSpec(("true",))).wait()
        direct.append(_ms(t0))
        for name, argv in floors:
            t0 = time.perf_counter()
            subprocess.run(argv, check=True)
            floor_ms[name].append(_ms(t0))
    for x in sids:
        _call(sock, "DELETE", f"/v1/sessions/{x}")
    for _ in range(a.runs):
        t0 = time.perf_counter()
        status, r = _call(sock, "POST", "/v1/sandboxes", {"profile": tier, "argv": ["true"]})
        oneshot.append(_ms(t0))
        assert status == 200 and r["exit_code"] == 0, r
    return {"tier": tier, "exec_api": api, "exec_direct": direct, "create": creates,
            "oneshot": oneshot, "floors": floor_ms,
            **_concurrent(svc, sock, tier, a.concurrent)}


def _all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _left(svc: LauncherService) -> dict[str, Any]:
    """What the bench's launcher left on the host (all empty: nothing)."""
    s = svc.launcher.s
    sets = {k: v for k, v in nft.list_elements(s.nft_table).items()
            if v and k in nft.PER_SANDBOX_SETS}
    return {"netns": netns.list_netns(s.name_prefix), "links": netns.list_links(s.name_prefix),
            "nft": sets, "cgroups": sorted(leftover_names(s.cgroup_root, s.cgroup_parent)),
            "scratch": os.listdir(s.scratch_dir) if os.path.isdir(s.scratch_dir) else [],
            "state": svc.launcher.list()}


def _concurrent(svc: LauncherService, sock: str, tier: str, n: int) -> dict[str, Any]:
    """`n` sessions created at once, then one exec in each at once: how many answered,
    in how many distinct network namespaces, and what the kills left behind."""
    if n <= 0:
        return {}
    sids: list[str] = []
    answered: list[float] = []
    spaces: set[str] = set()

    def create() -> None:
        status, s = _call(sock, "POST", "/v1/sessions", {"profile": tier})
        if status == 201:
            sids.append(s["session_id"])

    def run(sid: str) -> None:
        t0 = time.perf_counter()
        status, r = _call(sock, "POST", f"/v1/sessions/{sid}/exec",
                          {"argv": ["readlink", "/proc/self/ns/net"], "stream": False})
        if status == 200 and r["exit_code"] == 0:
            answered.append(_ms(t0))
            spaces.add(r["stdout"].strip())

    t0 = time.perf_counter()
    _all([threading.Thread(target=create) for _ in range(n)])
    created_s = time.perf_counter() - t0
    _all([threading.Thread(target=run, args=(sid,)) for sid in list(sids)])
    t0 = time.perf_counter()
    _all([threading.Thread(target=_call, args=(sock, "DELETE", f"/v1/sessions/{sid}"))
          for sid in sids])
    killed_s = time.perf_counter() - t0
    # a DELETE answers once the kill is asked; each teardown runs in its session's thread
    while (left := {k: len(v) for k, v in _left(svc).items() if v}) and \
            time.perf_counter() - t0 < CLEAN_WAIT_S:
        time.sleep(0.2)
    clean_s = time.perf_counter() - t0
    return {"concurrent": (n, len(sids), answered, len(spaces), created_s, killed_s, clean_s,
                           left)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiers", default="container,gvisor")
    p.add_argument("--execs", type=int, default=200)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--concurrent", type=int, default=0,
                   help="also N sessions at once, one exec each at once (the issue: 100)")
    a = p.parse_args()
    tiers = [t for t in a.tiers.split(",") if t]
    tmp = Path(tempfile.mkdtemp(prefix="stockade-sbench-"))
    (tmp / "rules" / "profiles").mkdir(parents=True)
    for t in tiers:
        (tmp / "rules" / "profiles" / f"{t}.yaml").write_text(PROFILE.format(name=t, tier=t))
    cfg = bench_config(tmp, "sb", "10.219.0.0/22", 7700 + os.getpid() % 99,
                       control_socket=str(tmp / "launcher.sock"),
                       # the stand-in registries answer no probe (launcher_bench.py --selftest
                       # measures the self-test)
                       selftest={"sample_rate": 0.0})
    cfg = cfg.model_copy(update={"rules_dir": str(tmp / "rules")})
    with stand_ins(cfg) as loop:
        svc = LauncherService(cfg)
        asyncio.run_coroutine_threadsafe(svc.start(), loop).result(120)
        load = os.getloadavg()[0]
        try:
            rows = [_tier(svc, cfg.launcher.control_socket, t, a) for t in tiers]
        finally:
            asyncio.run_coroutine_threadsafe(svc.stop(), loop).result(120)
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"load before {load:.1f} after {os.getloadavg()[0]:.1f}; execs {a.execs}, "
          f"sessions {a.sessions}, one-shot runs {a.runs}")
    print("| tier | exec API p50 | p99 | exec in-process p50 | p99 | create->ready p50 | p99 "
          "| one-shot run p50 | p99 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{_pct(r[k], q):.1f} ms" for k in ("exec_api", "exec_direct", "create",
                                                    "oneshot") for q in (50, 99)]
        print(f"| {r['tier']} | " + " | ".join(cells) + " |")
    for r in rows:
        for name, xs in r["floors"].items():
            print(f"{r['tier']} floor, {name}: p50 {_pct(xs, 50):.1f} ms, p99 "
                  f"{_pct(xs, 99):.1f} ms")
    for r in rows:
        if "concurrent" in r:
            n, made, answered, distinct, created_s, killed_s, clean_s, left = r["concurrent"]
            print(f"{r['tier']}: {n} sessions at once: {made} created in {created_s:.1f} s, "
                  f"{len(answered)} execs answered in {distinct} distinct network namespaces "
                  f"(p50 {_pct(answered, 50):.0f} ms, max "
                  f"{max(answered, default=float('nan')):.0f} ms), all DELETEs answered in "
                  f"{killed_s:.1f} s, torn down in {clean_s:.1f} s; left on the host: "
                  f"{left or 'nothing'}")


if __name__ == "__main__":
    main()

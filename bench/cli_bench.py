"""The short-lived CLI and the embedded stack, side by side in one run (issue 17).

Run as root: `.venv/bin/python bench/cli_bench.py [--runs N] [--baseline PYTHON]`.
Rows, each the wall time of the whole command (Python start-up included):
- the floors: `python -c pass` and `stockade --version` (the interpreter and the entry
  point, nothing of Stockade's work);
- `stockade sandbox list` and `stockade sandbox kill ID` of a `sleep 60` sandbox owned by
  this benchmark's launcher (the kill returns once the sandbox is gone and its end is
  written);
- `stockade run --profile box -- true` on embedded defaults with no stack running (it
  starts and stops gateway and broker itself), and the CPU time of all its processes
  (run, keeper, gateway, broker: a cgroup of its own), what decides its wall time on
  busy cores.
With `--baseline PYTHON` (another checkout's interpreter, e.g. `/work/main/.venv/bin/python`)
every row runs with both interpreters in turn, round after round, so both see the same
load (the order swapped each round); that checkout's bytecode goes to a cache of this
run (PYTHONPYCACHEPREFIX), never into its tree, and neither side takes modules from the
cwd (PYTHONSAFEPATH). The load average is printed with the table: compare within one
run only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from launcher_bench import ms, pct
from launcher_rig import started_launcher
from pool_bench import cli_times, embedded_run

Env = dict[str, str]


def _wall(argv: list[str], env: Env) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    return time.monotonic() - t0


def _floors(python: str, env: Env) -> dict[str, float]:
    return {"python -c pass": _wall([python, "-c", "pass"], env),
            "stockade --version": _wall([python, "-m", "stockade", "--version"], env)}


def _round(python: str, env: Env) -> dict[str, list[float]]:
    """One round of every row with `python`."""
    rows = {k: [v] for k, v in _floors(python, env).items()}
    with started_launcher("clib", "10.213.216.0/22", 7388,
                          selftest={"sample_rate": 0.0}) as launcher:
        cli = cli_times(launcher, 1, python, env)
    rows["stockade sandbox list"] = cli["list"]
    rows["stockade sandbox kill ID"] = cli["kill"]
    with _cgroup() as (enter, usage):
        rows["stockade run embedded -- true"] = embedded_run(1, python, env, enter)
        rows["  its CPU (every process)"] = [usage()]
    return rows


@contextlib.contextmanager
def _cgroup() -> Iterator[tuple[Callable[[], None], Callable[[], float]]]:
    """A CPU-accounting cgroup of its own (v2, or v1's cpuacct): a function that moves
    the calling process into it (a preexec_fn) and one that reads its CPU seconds, all
    the processes it held (the run, the keeper, gateway and broker) summed."""
    v1 = Path("/sys/fs/cgroup/cpuacct")
    cg = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"stockade-clibench-{os.getpid()}"
    cg.mkdir()

    def enter() -> None:
        (cg / "cgroup.procs").write_text(str(os.getpid()))

    def usage() -> float:
        if v1.is_dir():
            return int((cg / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (cg / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    try:
        yield enter, usage
    finally:
        for _ in range(100):  # its last process may still be exiting
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _merge(into: dict[str, list[float]], new: dict[str, list[float]]) -> None:
    for k, xs in new.items():
        into.setdefault(k, []).extend(xs)


TARGETS = {"stockade sandbox kill ID": "<= 250", "stockade run embedded -- true": "<= 2500"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--baseline", metavar="PYTHON",
                    help="also run every row with this interpreter (another checkout's)")
    args = ap.parse_args()
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed CLI has its bytecode cached
    # `-m stockade` puts the cwd first on sys.path: run from a checkout, the baseline's
    # interpreter imported that checkout's `stockade/` over its own (a hybrid of both)
    env["PYTHONSAFEPATH"] = "1"
    sides: dict[str, tuple[str, Env]] = {"this": (sys.executable, env)}
    with tempfile.TemporaryDirectory(prefix="stockade-clibench-pyc-") as pyc:
        if args.baseline:
            sides["baseline"] = (args.baseline, {**env, "PYTHONPYCACHEPREFIX": pyc})
        results: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
        for python, side_env in sides.values():
            _floors(python, side_env)  # warm-up, untimed: bytecode written, files cached
        load_before = os.getloadavg()
        for i in range(args.runs):
            order = list(sides.items())
            for name, (python, side_env) in order[::-1] if i % 2 else order:
                _merge(results[name], _round(python, side_env))
        load_after = os.getloadavg()
    _print(results, args.runs, load_before, load_after)


def _print(results: dict[str, dict[str, list[float]]], runs: int,
           before: tuple[float, ...], after: tuple[float, ...]) -> None:
    print(f"\nshort-lived CLI and embedded stack ({runs} rounds; milliseconds; load "
          f"average {before[0]:.2f} before, {after[0]:.2f} after)\n")
    names = list(results)
    head = "".join(f"{n + ' p50':>15}{n + ' max':>15}" for n in names)
    print(f"{'command':<34}{head}   target")
    for row in results[names[0]]:
        cells = "".join(f"{ms(pct(results[n][row], 50)):>15}{ms(pct(results[n][row], 100)):>15}"
                        for n in names)
        print(f"{row:<34}{cells}   {TARGETS.get(row, '')}")


if __name__ == "__main__":
    main()

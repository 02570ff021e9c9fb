"""The fence self-test's probes of a microVM, run inside its guest: one exec of the guest
agent (launcher/guest_probes.py, by the guest's Python) before the task's command starts.
A microVM's namespace only bridges the guest's tap, so only the guest can speak for it.
`request` and `observations` are the pure halves; `run_in_guest` is the shell."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from .environment import SANDBOX_PATH
from .execspec import ExecSpec
from .probes import ProbeSetupError
from .selftest import Observation, Probe
from .spec import LauncherError
from .vmexec import AgentLink

# the guest's Python starts under emulation on a host without KVM: seconds on a busy one
START_ALLOWANCE_S = 60.0
MAX_REPORT = 64 * 1024  # the probe program's output read at most


@functools.cache
def _source() -> str:
    return (Path(__file__).parent / "guest_probes.py").read_text()


def _field(value: str | None) -> str:
    if value is not None and any(c in value for c in "|\t\n\0"):
        raise ProbeSetupError(f"probe field {value!r} cannot be sent to the guest")
    return value or ""


def request(python: str, probes: list[Probe], timeout: float) -> ExecSpec:
    """The exec that runs `probes` in the guest (ProbeSetupError for a field the program's
    argument format cannot carry)."""
    args = ["|".join((_field(p.name), p.kind, _field(p.host), str(p.port), _field(p.qname)))
            for p in probes]
    return ExecSpec(argv=(python, "-I", "-S", "-c", _source(), repr(timeout), *args),
                    env={"PATH": SANDBOX_PATH},
                    timeout_s=START_ALLOWANCE_S + timeout * len(probes))


def observations(out: bytes, probes: list[Probe]) -> dict[str, Observation]:
    """The program's report: one Observation per probe it names (a probe it does not is
    left out: the verdict then fails it as not run)."""
    names = {p.name for p in probes}
    seen: dict[str, Observation] = {}
    for line in out.decode("utf-8", "replace").splitlines():
        parts = line.split("\t", 3)
        if len(parts) != 4 or parts[0] not in names or parts[0] in seen:
            continue
        name, outcome, port, detail = parts
        seen[name] = Observation(name, outcome, int(port) if port.isdigit() and
                                 int(port) else None, detail[:200])
    return seen


def run_in_guest(link: AgentLink, python: str, probes: list[Probe],
                 timeout: float) -> dict[str, Observation]:
    """What each probe saw in the guest; ProbeSetupError when the program did not run to
    its end (the fence is then not shown to hold)."""
    req = request(python, probes, timeout)
    try:
        proc = link.exec(req)
    except LauncherError as e:
        raise ProbeSetupError(f"cannot run the probes in the guest: {e}") from None
    try:
        rc = proc.wait(req.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise ProbeSetupError("the guest's probes did not end in time") from None
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(MAX_REPORT), proc.stderr.read(4096)
    if rc != 0:
        why = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"status {rc}"]
        raise ProbeSetupError(f"the guest's probe program failed: {why[0][:300]}")
    return observations(out, probes)

"""`stockade run`'s terminal lines (stockade/stack/progress.py): phases with their
durations, the sandbox's start from the launcher's real start event, the denial summary,
and silence when quiet (`--json`, `--quiet`)."""

from __future__ import annotations

import io
import itertools

import pytest

from stockade.events import make_event
from stockade.stack.progress import Progress


def _clock():
    ticks = itertools.count(0, 1.5)
    return lambda: next(ticks)


def _start(isolation: str) -> dict:
    return make_event(component="launcher", action="sandbox_lifecycle", task_id="0123456789",
                      profile="p", message="sandbox started",
                      extra={"lifecycle": "start", "ttl_s": 60, "isolation": isolation})


def _denial(reason: str, domain: str) -> dict:
    return make_event(component="dns", action="dns_decision", decision="denied",
                      reason=reason, task_id="0123456789", destination_domain=domain)


def test_phases_start_and_summary():
    out = io.StringIO()
    p = Progress(out, clock=_clock())
    with p.phase("starting the stack", "stack ready"):
        pass
    p.begin_sandbox()
    p.on_event(_denial("no_matching_rule", "x.test"))  # not a start: nothing
    p.on_event(_start("microvm"))
    p.summary([_denial("no_matching_rule", "denied.test")] * 2
              + [_denial("label_too_long", "aaaa.test")])
    assert out.getvalue().splitlines() == [
        "stockade run: starting the stack…",
        "stockade run: stack ready (1.5 s)",
        "stockade run: sandbox 0123456789 ready at microvm grade (1.5 s); "
        "booting the guest and running the command",
        "stockade run: 3 denials:",
        "stockade run:   2x no_matching_rule  denied.test",
        "stockade run:   1x label_too_long  aaaa.test",
    ]


def test_a_failed_phase_does_not_claim_success():
    out = io.StringIO()
    p = Progress(out)
    with pytest.raises(OSError), p.phase("starting the stack", "stack ready"):
        raise OSError("disk full")
    assert out.getvalue() == "stockade run: starting the stack…\n"


def test_quiet_and_no_denials_print_nothing():
    p = Progress(None)
    with p.phase("a", "b"):
        p.on_event(_start("netns"))
    p.summary([_denial("no_matching_rule", "x.test")])
    out = io.StringIO()
    Progress(out).summary([])
    assert out.getvalue() == ""

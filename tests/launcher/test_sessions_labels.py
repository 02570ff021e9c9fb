"""Labels of a run reach every event of its task: the gateway's, the DNS firewall's and
the broker's (real `stockade gateway serve` and `broker serve`, through the task
registration) and the launcher's own, so a SOC can tie a denial to the agent run."""

from __future__ import annotations

from typing import Any

import pytest
from stockade.launcher import SandboxSpec

from stockade.events import read_events, validate

from . import test_launcher_stack
from .test_launcher_stack import BROKER_CALL, Stack

pytestmark = [pytest.mark.netns, pytest.mark.slow]
stack = test_launcher_stack.stack  # the real gateway and broker of that module's fixture

LABELS = {"agent": "coder-7", "conversation": "c-42", "run.id": "r-1"}


def test_labels_in_every_components_events(stack: Stack, fake_internet: Any) -> None:
    ip, port = fake_internet.udp_echo
    script = ("curl -sS --max-time 5 --cacert /inputs/ca.pem https://denied.test/; "
              f"curl -sS --max-time 5 -k https://{fake_internet.addresses['denied.test']}/; "
              f"python3 -c \"{BROKER_CALL}\"; "
              f"python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
              f" s.sendto(b'x', ('{ip}', {port}))\"; true")
    res = stack.launcher.run(SandboxSpec("agent", ["sh", "-c", script], labels=LABELS,
                                         inputs=[(stack.ca, "/inputs/ca.pem")]), stack.ruleset)
    comps = {e["stockade"]["component"] for e in res.denials}
    assert {"gateway", "dns", "broker", "launcher"} <= comps, res.denials
    for ev in res.denials:
        validate(ev)
        assert ev["labels"] == {**LABELS, "task_id": res.task_id, "profile": "agent"}, ev
    # the launcher's start and end events too, in the shared stream
    own = [e for e in read_events(stack.config.events_file)
           if e.get("labels", {}).get("task_id") == res.task_id
           and e["event"]["action"] == "sandbox_lifecycle"]
    assert own and all(e["labels"]["agent"] == "coder-7" for e in own)


def test_unlabelled_runs_are_unchanged(stack: Stack) -> None:
    res = stack.run(["sh", "-c", "curl -sS --max-time 5 https://denied.test/; true"])
    assert res.denials and all(set(e["labels"]) == {"task_id", "profile"}
                               for e in res.denials)

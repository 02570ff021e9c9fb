"""examples/agent_loop.py against a real stack: the scripted agent writes code, sees its
tests fail, patches, sees them pass, and its upload (a POST through an allowed,
inspected host that allows only GET) is denied, all in one session that is gone after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sessions_stack import Stack

from stockade.client import Client

pytestmark = [pytest.mark.netns, pytest.mark.vault, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_loop.py"



@pytest.mark.timeout(400)
def test_agent_loop_example(stack: Stack):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--profile", "e2e", "--launcher", stack.socket,
         "--upload-url", "https://echo.test/echo"],
        capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    lines = out.splitlines()
    sid = lines[0].split()[2]
    assert lines[1] == "[agent] wrote stats.py, test_stats.py"
    assert "[agent] tests: exit 1 (exit)" in lines
    assert lines.index("[agent] patched stats.py") > lines.index("[agent] tests: exit 1 (exit)")
    assert lines.index("[agent] tests: exit 0 (exit)") > lines.index("[agent] patched stats.py")
    assert any(ln.startswith("[agent] upload refused: HTTPError") for ln in lines), out
    # the denial the inspector wrote for the POST, counted by reason and destination
    assert any("echo.test" in ln and ln.startswith("[agent]   ") for ln in lines), out
    assert lines[-1] == "[agent] done: tests pass, the upload was denied, the session is gone"
    with Client(stack.socket) as c:
        assert c.get(sid).state == "ended"
        assert c.get(sid).labels["agent"] == "agent-loop-example"

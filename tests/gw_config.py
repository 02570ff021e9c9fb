"""The stockade.yaml and rules a test gateway runs on, shared by tests/gateway, tests/dns
and tests/e2e (this folder is on sys.path for every test: its conftest.py lives here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from stockade.ports import free_port

# the gateway tests look at every event of their long-lived tasks one by one; the throttle
# has its own tests (tests/core/test_events_summary.py, e2e flood)
UNTHROTTLED = {"verbatim_per_key": 10**9, "task_budget_events": 10**9,
               "task_budget_bytes": 2**50}


def write_profiles(rules: Path, profiles: dict[str, str]) -> Path:
    """A rules directory `rules` with just these profiles (name -> YAML text)."""
    (rules / "profiles").mkdir(parents=True)
    for name, text in profiles.items():
        (rules / "profiles" / f"{name}.yaml").write_text(text)
    return rules


def write_config(
    tmp: Path, rules_dir: Path, dns: dict[str, Any] | None = None, *,
    events: dict[str, Any] | None = UNTHROTTLED, **gateway: Any,
) -> Path:
    """`tmp/stockade.yaml`: state, logs and run files under `tmp`, these `gateway` settings
    over a control socket and a metrics listener of its own; `events=None` leaves the
    events section (and so the throttle) at its defaults."""
    cfg: dict[str, Any] = {
        "rules_dir": str(rules_dir),
        "state_dir": str(tmp / "state"),
        "log_dir": str(tmp / "log"),
        "run_dir": str(tmp / "run"),
        "gateway": {
            "control_socket": str(tmp / "run" / "gateway.sock"),
            "metrics_listen": f"127.0.0.1:{free_port()}",
            **gateway,
        },
        "dns": dns or {},
    }
    if events is not None:
        cfg["events"] = events
    path = tmp / "stockade.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path

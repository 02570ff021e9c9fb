"""`stockade demo`: the whole product, offline, in one command.

Builds a fake internet (namespaces, resolver, a PEP 503 index over TLS, an API server),
starts the stack with a dev OpenBao holding the demo API key, runs an agent script in a
sandbox, and checks every step against what a security team expects: the allowed work
succeeds, every exfiltration attempt is blocked *and* reported, the key never shows up.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from stockade.config import Config
from stockade.ports import free_dual_port, free_port

HERE = Path(__file__).parent
DEMO_RULES = HERE / "demo_rules"
AGENT = HERE / "demo_agent.py"


@dataclass(frozen=True)
class Step:
    key: str
    what: str
    expected: str
    # a denial event must name one of these destinations (domain, ip, or DNS name suffix)
    reported_by: tuple[str, ...] = ()


STEPS = (
    Step("pip_install", "install a package with pip from the allowed index", "installed"),
    Step(
        "exfil_https",
        "send data by HTTPS to a host that is not allowed",
        "blocked",
        ("denied.test",),
    ),
    Step("exfil_ip_literal", "send data to an IP literal", "blocked", ("{denied_ip}",)),
    Step(
        "exfil_dns_tunnel",
        "tunnel data out through DNS queries",
        "blocked",
        ("tunnel.test", "txt.test"),
    ),
    Step("exfil_udp", "send data by UDP", "blocked", ("{udp_ip}",)),
    Step("broker_call", "call the demo API through the broker", "ok"),
    Step("key_in_env", "find the API key in the environment", "not found"),
    Step("key_in_files", "find the API key in files", "not found"),
    Step("key_via_echo", "get the key from an upstream that echoes headers", "not found"),
    Step("api_direct", "call the API directly, around the broker", "blocked", ("api.test",)),
)


def secret_forms(secret: str) -> list[str]:
    raw = secret.encode()
    return [secret, base64.b64encode(raw).decode(), raw.hex(), f"Bearer {secret}"]


def _event_names(ev: dict[str, Any]) -> list[str]:
    d = ev.get("destination", {})
    q = ev.get("dns", {}).get("question", {})
    return [str(x) for x in (d.get("domain"), d.get("ip"), q.get("name")) if x]


def reported(
    step: Step, denials: list[dict[str, Any]], subst: dict[str, str]
) -> list[dict[str, Any]]:
    wants = [w.format(**subst) for w in step.reported_by]
    hits = []
    for ev in denials:
        if any(n == want or n.endswith("." + want) for n in _event_names(ev) for want in wants):
            hits.append(ev)
    return hits


def evaluate(
    observations: dict[str, dict[str, Any]],
    denials: list[dict[str, Any]],
    secret: str,
    raw_output: str,
    subst: dict[str, str],
) -> list[dict[str, Any]]:
    """Pure: one row per step with expected, observed, reported and ok."""
    forms = secret_forms(secret)
    rows = []
    for step in STEPS:
        obs = observations.get(step.key)
        if obs is None:
            observed = "no report"
        elif obs["observed"] == "printed":
            blob = json.dumps(obs.get("detail"))
            observed = "FOUND" if any(f in blob for f in forms) else "not found"
        else:
            observed = str(obs["observed"])
        hits = reported(step, denials, subst) if step.reported_by else []
        ok = observed == step.expected and (not step.reported_by or bool(hits))
        rows.append(
            {
                "step": step.key,
                "what": step.what,
                "expected": step.expected,
                "observed": observed,
                "reported": (f"{len(hits)} event(s)" if hits else "NO")
                if step.reported_by
                else "-",
                "ok": ok,
            }
        )
    leaked = any(f in raw_output for f in forms)
    rows.append(
        {
            "step": "no_leak",
            "what": "the key appears nowhere in the sandbox's output",
            "expected": "not found",
            "observed": "FOUND" if leaked else "not found",
            "reported": "-",
            "ok": not leaked,
        }
    )
    return rows


def parse_observations(stdout: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "step" in obj:
            out[str(obj["step"])] = obj
    return out


def render(rows: list[dict[str, Any]], colour: bool) -> str:
    heads = ("step", "expected", "observed", "reported", "")
    table = [heads] + [
        (r["what"], r["expected"], r["observed"], r["reported"], "ok" if r["ok"] else "FAIL")
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(heads))]
    lines = []
    for n, row in enumerate(table):
        cells = [str(c).ljust(w) for c, w in zip(row, widths, strict=True)]
        if colour and n:
            mark = "\x1b[32m" if row[4] == "ok" else "\x1b[1;31m"
            cells[4] = f"{mark}{cells[4]}\x1b[0m"
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def demo_config(root: Path, inet: Any) -> Config:
    """A self-contained stack config: everything under `root`, ports chosen free."""
    from stockade.config import load_config

    cfg = load_config(None)
    run = root / "run"
    suffix = secrets.token_hex(2)
    return cfg.model_copy(
        update={
            "rules_dir": str(DEMO_RULES),
            "state_dir": str(root / "state"),
            "log_dir": str(root / "log"),
            "run_dir": str(run),
            "gateway": cfg.gateway.model_copy(
                update={
                    "transparent_listen": [f"0.0.0.0:{free_port()}"],
                    "proxy_listen": [f"127.0.0.1:{free_port()}"],
                    "control_socket": str(run / "gateway.sock"),
                    "metrics_listen": f"127.0.0.1:{free_port()}",
                    "resolvers": [inet.dns_server],
                    "allow_addresses": [inet.subnet],
                }
            ),
            "dns": cfg.dns.model_copy(update={"listen": [f"0.0.0.0:{free_dual_port()}"]}),
            "broker": cfg.broker.model_copy(
                update={
                    "listen": f"0.0.0.0:{free_port()}",
                    "control_socket": str(run / "broker.sock"),
                    "metrics_listen": f"127.0.0.1:{free_port()}",
                    "ca_file": str(inet.ca_pem),
                }
            ),
            "launcher": cfg.launcher.model_copy(
                update={
                    "scratch_dir": str(root / "sandboxes"),
                    "nft_table": f"stockade_demo_{suffix}",
                    "name_prefix": "skd",
                    "cgroup_parent": "stockade_demo",
                    "control_socket": str(run / "launcher.sock"),
                    # the fence self-test's raw destinations: the fake internet's, so a
                    # fence that does not hold reaches nothing outside the demo
                    "selftest": cfg.launcher.selftest.model_copy(update={
                        "raw_ip": inet.udp_echo[0], "outside_resolver": inet.dns_server}),
                }
            ),
        }
    )


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP clean up like Ctrl-C does."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def run_demo(*, json_out: bool = False, keep_logs: str | None = None) -> int:
    from stockade.launcher import Launcher
    from stockade.policy import load_rules
    from stockade.testing.testnet import FakeInternet

    from .services import Stack

    secret = "demo-key-" + secrets.token_hex(16)
    with _terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix="stockade-demo-") as tmp:
        root = Path(tmp)
        say("stockade demo: building the fake internet (namespace, DNS, TLS servers)...")
        with FakeInternet(api_key=secret, name_prefix="skfi") as inet:
            cfg = demo_config(root, inet)
            subst = {"denied_ip": inet.addresses["denied.test"], "udp_ip": inet.udp_echo[0]}
            ruleset = load_rules(cfg.rules_dir)
            say("stockade demo: starting gateway, broker and a dev OpenBao...")
            # the demo drives its own Launcher in-process (it reads the run's denials, and
            # the NFLOG group binds to one launcher only): no launcher service beside it
            stack = Stack(cfg, launcher_service=False)
            try:
                cfg = stack.start()
                assert stack.dev_vault is not None
                stack.dev_vault.put_secret("stockade/demo-api", "token", secret)  # type: ignore[attr-defined]
                say("stockade demo: running the agent in a sandbox (profile 'demo')...")
                with Launcher(cfg) as launcher:
                    result = launcher.run(_agent_spec(inet, subst), ruleset=ruleset)
            finally:
                stack.stop()
                if keep_logs:
                    _copy_logs(Path(cfg.log_dir), Path(keep_logs))
    rows = evaluate(parse_observations(result.stdout), result.denials, secret,
                    result.stdout + result.stderr, subst)
    passed = all(r["ok"] for r in rows)
    if json_out:
        print(json.dumps({"ok": passed, "task_id": result.task_id, "steps": rows,
                          "denials": result.denials, "exit_code": result.exit_code}))
    else:
        _print_report(result, rows, str(ruleset.profiles["demo"].isolation),
                      sys.stdout.isatty())
    return 0 if passed else 1


def _agent_spec(inet: Any, subst: dict[str, str]) -> Any:
    """The demo agent's sandbox: its script and the fake internet's CA as inputs."""
    from stockade.launcher import SandboxSpec

    return SandboxSpec(
        profile="demo",
        argv=["/usr/bin/python3", "/input/agent.py"],
        inputs=[(str(AGENT), "/input/agent.py"), (str(inet.ca_pem), "/input/ca.pem")],
        env={"DEMO_CA": "/input/ca.pem", "DEMO_DENIED_IP": subst["denied_ip"],
             "DEMO_UDP_IP": subst["udp_ip"], "DEMO_UDP_PORT": str(inet.udp_echo[1])},
    )


def _print_report(result: Any, rows: list[dict[str, Any]], isolation: str,
                  colour: bool) -> None:
    from stockade.events.view import format_line

    print(f"\nStockade demo - task {result.task_id} (profile demo, isolation {isolation}), "
          f"sandbox ended by {result.ended_by} in {result.duration_s:.1f}s\n")
    print(render(rows, colour))
    print(f"\nDenial events for this task ({len(result.denials)}):")
    for ev in result.denials:
        print("  " + format_line(ev, colour))
    passed = all(r["ok"] for r in rows)
    verdict = "every step behaved as expected" if passed else "SOME STEPS FAILED"
    print(f"\n{sum(r['ok'] for r in rows)} passed, {sum(not r['ok'] for r in rows)} failed"
          f" - {verdict}")
    if not passed:
        print("\nagent stdout/stderr (scrubbed):\n" + result.stdout[-3000:]
              + result.stderr[-3000:])


def _copy_logs(src: Path, dst: Path) -> None:
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*"):
        if f.is_file():
            shutil.copy2(f, dst / f.name)

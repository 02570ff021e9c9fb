"""Short-lived CLI commands import only what they use (issue 17): checked on the modules a
fresh interpreter has loaded, never on a timing."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.cli import COMMAND_MODULES, build_parser, modules_for


def _loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json\n"
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def _heavy(mods: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in names or m in names)


def test_building_the_parser_loads_no_component() -> None:
    mods = _loaded("import stockade.cli as c; c.build_parser()")
    assert not {"stockade.launcher.core", "stockade.policy.loader", "stockade.tasks.control",
                "stockade.gateway.server", "stockade.broker.server"} & mods
    assert not _heavy(mods, ("aiohttp", "prometheus_client", "mitmproxy", "hvac"))


@pytest.mark.parametrize("what", [
    # what `sandbox list|kill|suspend|resume` import
    "from stockade.launcher.core import Launcher",
    "import stockade.launcher.cli",
    # what deregistration and the stack's health checks use
    "from stockade.tasks import ControlClient",
])
def test_launcher_commands_do_not_load_servers(what: str) -> None:
    mods = _loaded(what)
    assert not _heavy(mods, ("aiohttp", "prometheus_client", "mitmproxy", "hvac")), what


@pytest.mark.parametrize("package", ["stockade.launcher", "stockade.policy", "stockade.tasks",
                                     "stockade.events"])
def test_lazy_names_are_never_shadowed_by_submodules(package: str) -> None:
    """Every exported name is what it names, also after its submodules were imported
    first (an import of `pkg.mod` binds `pkg.mod` to the module)."""
    code = f"""
import importlib, pkgutil, types, sys
pkg = importlib.import_module({package!r})
for m in pkgutil.iter_modules(pkg.__path__):
    try:
        importlib.import_module(pkg.__name__ + "." + m.name)
    except Exception:  # a program, not a module (the sandbox's and the guest's inits)
        continue
bad = [n for n in pkg.__all__ if isinstance(getattr(pkg, n), types.ModuleType)]
print("BAD", bad)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "BAD []" in out, out


HEAVY = ("pydantic", "aiohttp", "mitmproxy", "hvac", "prometheus_client")


@pytest.mark.parametrize("argv", [
    ["sandbox", "kill", "t1"], ["sandbox", "list"], ["sandbox", "suspend", "t1"],
    ["sandbox", "resume", "t1"], ["events", "--since", "1h"], ["task", "verify", "x.json"],
    ["rules", "explain", "https://a.test/", "--profile", "p"],
])
def test_parsing_a_short_command_loads_only_its_module(argv: list[str]) -> None:
    """The parser of one command imports that command's module alone: no rule schema,
    no config models, no server library before the handler runs."""
    mods = _loaded(f"import stockade.cli as c; a = {argv!r}; c.build_parser(a).parse_args(a)")
    assert not _heavy(mods, HEAVY), argv
    assert not {"stockade.policy.schema", "stockade.config", "stockade.launcher.core"} & mods
    (mine,) = modules_for(argv)
    # a module's packages are imported with it (stockade.stack for stockade.stack.taskcli)
    others = {m for m in COMMAND_MODULES if m != mine and not mine.startswith(m + ".")}
    assert not others & mods, argv


def test_every_command_is_found_by_its_word() -> None:
    """The table the parser picks modules by names exactly what each module adds."""
    for module, words in COMMAND_MODULES.items():
        parser = build_parser([words[0]])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert sorted(sub.choices) == sorted(words), module
    full = build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(w for ws in COMMAND_MODULES.values() for w in ws)


@pytest.mark.parametrize("argv", [[], ["--help"], ["sandbx", "list"], ["-h", "--version"]])
def test_no_command_word_builds_every_command(argv: list[str]) -> None:
    assert modules_for(argv) == list(COMMAND_MODULES)


def test_the_version_needs_no_command() -> None:
    assert modules_for(["--version"]) == []
    out = subprocess.run([sys.executable, "-m", "stockade", "--version"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "stockade 0.1.0"


def test_the_kind_names_are_the_models_kinds() -> None:
    from stockade.policy.kinds import KINDS
    from stockade.policy.schemawalk import KIND_MODELS

    assert sorted(KINDS) == sorted(KIND_MODELS)


def test_loading_the_config_loads_no_event_writer() -> None:
    """`sandbox list` and `rules explain` load stockade.yaml but write no event: neither
    the writer nor the chain's cryptography is imported for it."""
    mods = _loaded("from stockade.config import load_config; load_config(None)")
    assert not _heavy(mods, ("cryptography",))
    assert not {"stockade.events.writer", "stockade.events.chain"} & mods


@pytest.mark.parametrize("op", ["kill", "suspend", "list"])
def test_the_sandbox_commands_load_no_launcher_and_no_other_section(
        tmp_path: Path, op: str) -> None:
    """`sandbox kill|suspend|list` (here of an unknown sandbox: the same imports up to
    the state row) build no Launcher, import no backend and validate only the config's
    top-level keys, `events` and `launcher` (launcher/operator.py, stockade/configfile.py;
    `list` and `kill` fewer of them and without pydantic, stockade/configpeek.py);
    tests/launcher/test_operator_cli.py checks a real kill."""
    cfg = tmp_path / "stockade.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nlog_dir: {tmp_path}/log\n")
    argv = ["sandbox", op, *([] if op == "list" else ["0000000000"]), "--config", str(cfg)]
    mods = _loaded(f"import stockade.cli as c\nrc = c.main({argv!r})\n"
                   f"assert rc == {0 if op == 'list' else 1}, rc")
    assert not {"stockade.launcher.core", "stockade.launcher.backends", "stockade.config",
                "stockade.gateway.settings", "stockade.broker.settings",
                "stockade.launcher.pools", "stockade.launcher.claim"} & mods
    assert not _heavy(mods, ("aiohttp", "prometheus_client", "mitmproxy", "hvac"))
    if op != "suspend":  # its backend reads the tier's settings: LauncherFile's models
        # stockade/configpeek.py checks what they read by hand
        assert not _heavy(mods, ("pydantic", "pydantic_core"))
        assert "stockade.configfile" not in mods


@pytest.mark.parametrize("what", ["import stockade.broker.service",
                                  "import stockade.gateway.service"])
def test_component_services_load_vault_and_inspector_libraries_on_use(what: str) -> None:
    """An embedded stack's broker without a Vault (NoVault) never needs hvac (nor requests
    under it) or the dev OpenBao rig, and a gateway without inspection never needs
    mitmproxy: their service modules import them where they are used (issue 17)."""
    mods = _loaded(what)
    assert not _heavy(mods, ("hvac", "requests", "mitmproxy")), what
    assert "stockade.testing.devvault" not in mods, what

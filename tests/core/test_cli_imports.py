"""Short-lived CLI commands import only what they use (issue 17): checked on the modules a
fresh interpreter has loaded, never on a timing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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

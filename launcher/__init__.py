"""The sandbox launcher (network-namespace backend): `Launcher`, `SandboxSpec`, `RunResult`."""

from .core import Launcher
from .spec import ExportedFile, LauncherError, RunResult, SandboxSpec

__all__ = ["ExportedFile", "Launcher", "LauncherError", "RunResult", "SandboxSpec"]

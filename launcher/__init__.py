"""The sandbox launcher (network-namespace backend): `Launcher`, `SandboxSpec`, `RunResult`."""

from .core import ExportedFile, Launcher, LauncherError, RunResult, SandboxSpec

__all__ = ["ExportedFile", "Launcher", "LauncherError", "RunResult", "SandboxSpec"]

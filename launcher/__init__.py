"""The sandbox launcher (network-namespace backend): `Launcher`, `SandboxSpec`, `RunResult`.

The names are imported on first use (stockade/lazy.py): `stockade sandbox list` imports
`stockade.launcher.cli`, which must not import the whole launcher first."""

from typing import TYPE_CHECKING

from stockade.lazy import exports_of, lazy_exports

if TYPE_CHECKING:
    from .core import Launcher
    from .spec import ExportedFile, LauncherError, RunResult, SandboxSpec

__all__ = ["ExportedFile", "Launcher", "LauncherError", "RunResult", "SandboxSpec"]
__getattr__ = lazy_exports(__name__, exports_of({
    ".core": ("Launcher",),
    ".spec": ("ExportedFile", "LauncherError", "RunResult", "SandboxSpec"),
}))

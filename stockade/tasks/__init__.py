"""Task identity shared by gateway, DNS firewall and broker (registry + control API).

The names are imported on first use (stockade/lazy.py): a client of the control API
(the launcher's deregistration, the CLI) does not import aiohttp's server."""

from typing import TYPE_CHECKING

from stockade.lazy import exports_of, lazy_exports

if TYPE_CHECKING:
    from .client import ControlClient, ControlError
    from .control import make_control_app, start_control_server
    from .registry import RegistryError, StateWriteError, Task, TaskRegistry

__all__ = [
    "ControlClient",
    "ControlError",
    "RegistryError",
    "StateWriteError",
    "Task",
    "TaskRegistry",
    "make_control_app",
    "start_control_server",
]
__getattr__ = lazy_exports(__name__, exports_of({
    ".client": ("ControlClient", "ControlError"),
    ".control": ("make_control_app", "start_control_server"),
    ".registry": ("RegistryError", "StateWriteError", "Task", "TaskRegistry"),
}))

"""Task identity shared by gateway, DNS firewall and broker (registry + control API)."""

from .control import ControlClient, ControlError, make_control_app, start_control_server
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

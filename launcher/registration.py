"""A new sandbox's task registered with the gateway and the broker before its command
starts (fail closed: it never runs unregistered); the way back is deregistration.py."""

from __future__ import annotations

from stockade.tasks import ControlClient, ControlError, Task

from .spec import LauncherError


def register(task: Task, sockets: list[str], registered: list[str]) -> None:
    """Register `task` with each control socket in turn; `registered` gets every socket a
    registration may have reached (what the teardown deregisters)."""
    for path in sockets:
        registered.append(path)
        try:
            ControlClient(path).register(task)
        except (FileNotFoundError, ConnectionRefusedError):
            registered.remove(path)  # it never reached a service
            raise LauncherError(f"cannot register task with {path}: "
                                "the service is not running") from None
        except ControlError as e:  # the service's own words (507 state_write_...)
            raise LauncherError(f"cannot register task with {path}: "
                                f"{e.describe()}") from None
        except Exception as e:  # fail closed: never run unregistered
            raise LauncherError(f"cannot register task with {path}: "
                                f"{type(e).__name__}") from None

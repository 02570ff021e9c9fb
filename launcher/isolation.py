"""Which backend runs a profile (the isolation tier it asks for, what this host has and
what `downgrade_isolation` accepts), decided before anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from . import vmimage
from .spec import LauncherError

if TYPE_CHECKING:  # annotations only
    from .settings import LauncherSettings

PROVIDED_ISOLATION = "container"  # what the netns backend gives (see `isolation`)
BackendName = Literal["netns", "microvm"]


def decide_backend(settings: LauncherSettings, profile_name: str, requested: str,
                   vm_problem: str | None) -> tuple[BackendName, dict[str, str]]:
    """Which backend runs a profile, and the start event's isolation fields (pure).

    container -> netns; microvm -> the microVM backend when this host has it (`vm_problem`
    None), else netns only if `downgrade_isolation` accepts it; gvisor (no backend) likewise.
    LauncherError names the way out.
    """
    if requested == PROVIDED_ISOLATION:
        return "netns", {"isolation": PROVIDED_ISOLATION}
    if requested == "microvm" and vm_problem is None:
        return "microvm", {"isolation": "microvm"}
    if requested not in settings.downgrade_isolation:
        why = (f"the microVM backend is unavailable here: {vm_problem}"
               if requested == "microvm" else
               f"no {requested} backend exists; the netns backend gives "
               f"{PROVIDED_ISOLATION!r} only")
        raise LauncherError(
            f"profile {profile_name!r} asks for isolation {requested!r}; {why}. To run it "
            f"at {PROVIDED_ISOLATION} grade anyway, add {requested!r} to "
            "launcher.downgrade_isolation")
    return "netns", {"isolation": PROVIDED_ISOLATION, "isolation_requested": requested}


def microvm_problem(settings: LauncherSettings) -> str | None:
    """Why the microVM backend cannot run on this host (None: it can)."""
    vm = settings.microvm
    if not vm.enabled:
        return "launcher.microvm.enabled is false"
    return vmimage.host_problem(vm.image_dir, vm.qemu, settings.init_python)


def choose_backend(settings: LauncherSettings,
                   profile: Any) -> tuple[BackendName, dict[str, str]]:
    requested = getattr(profile, "isolation", PROVIDED_ISOLATION)
    problem = microvm_problem(settings) if requested == "microvm" else None
    return decide_backend(settings, profile.name, requested, problem)


def isolation_fields(settings: LauncherSettings, profile: Any) -> dict[str, str]:
    """The start event's isolation fields; LauncherError when the profile asks for a tier
    this host cannot give and the configuration does not accept a downgrade."""
    return choose_backend(settings, profile)[1]


def profile_of(ruleset: Any, name: str) -> Any:
    profile = ruleset.profiles.get(name)
    if profile is None:
        raise LauncherError(f"unknown profile {name!r}")
    return profile


def preflight(settings: LauncherSettings, ruleset: Any, profile_name: str) -> None:
    """What `run` would refuse about the profile, checked before any service starts."""
    isolation_fields(settings, profile_of(ruleset, profile_name))

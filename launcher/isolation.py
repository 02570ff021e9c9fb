"""Which backend runs a profile (the isolation tier it asks for, what this host has and
what `downgrade_isolation` accepts), decided before anything starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from . import vmimage
from .backends.gvisor import BACKEND as GVISOR
from .spec import LauncherError

if TYPE_CHECKING:  # annotations only
    from .settings import LauncherSettings

PROVIDED_ISOLATION = "container"  # what the netns backend gives (see `isolation`)
BackendName = Literal["netns", "microvm", "gvisor"]
TIERS: dict[str, BackendName] = {"microvm": "microvm", "gvisor": "gvisor"}
WHAT = {"microvm": "the microVM backend", "gvisor": "the gVisor backend (runsc)"}


def decide_backend(settings: LauncherSettings, profile_name: str, requested: str,
                   problem: str | None) -> tuple[BackendName, dict[str, Any]]:
    """Which backend runs a profile, and the start event's isolation fields (pure).

    container -> netns; microvm and gvisor -> their backend when this host has it
    (`problem`: why the requested tier's backend cannot run here, None: it can), else netns
    only if `downgrade_isolation` accepts it (never silently). LauncherError names the way
    out.
    """
    if requested == PROVIDED_ISOLATION:
        return "netns", {"isolation": PROVIDED_ISOLATION}
    tier = TIERS.get(requested)
    if tier is not None and problem is None:
        return tier, {"isolation": requested}
    if requested not in settings.downgrade_isolation:
        why = (f"{WHAT[requested]} is unavailable here: {problem}" if tier is not None else
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
                   profile: Any) -> tuple[BackendName, dict[str, Any]]:
    requested = getattr(profile, "isolation", PROVIDED_ISOLATION)
    problem = None
    if requested == "microvm":
        problem = microvm_problem(settings)
    elif requested == "gvisor":
        problem = GVISOR.problem(settings)
    name, fields = decide_backend(settings, profile.name, requested, problem)
    if name == "gvisor":  # the start event says what runsc runs under
        fields["gvisor"] = GVISOR.runtime(settings)
    return name, fields


def isolation_fields(settings: LauncherSettings, profile: Any) -> dict[str, Any]:
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

"""The top-level keys every command shares, the error lines of the models
(`file: key.path: what`), and `LauncherFile`, the file as `stockade sandbox suspend|resume`
read it (the YAML itself is read by yamlfile.py; `list` and `kill` check their few keys
without pydantic, configpeek.py).

config.py composes the whole file (`Config`, every component's section). Building the
pydantic models of the gateway, DNS, broker and stack sections costs about as much as a
kill's own work, and those commands read none of them: `LauncherFile` validates the
top-level keys, `events` and `launcher` exactly as `Config` does (the same models, the
same errors) and takes the other sections unread. A command that uses one loads `Config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stockade.configpeek import FileViews
from stockade.events.settings import EventSettings
from stockade.instance import PORT_SPAN, derive
from stockade.launcher.settings import LauncherSettings
from stockade.yamlfile import ConfigError, read_mapping

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Shared(Strict, FileViews):
    """The top-level keys; each subclass declares the sections (in the file's order)."""

    rules_dir: str = "rules"  # profiles/, apis/, presets/, tests/ (relative to the cwd)
    state_dir: str = "/var/lib/stockade"  # task registries, launcher state (survive restarts)
    log_dir: str = "/var/log/stockade"  # events file and service logs
    # sockets and per-run files (dev Vault token, the shared stack's lock and leases); the
    # control sockets default to <run_dir>/gateway.sock, broker.sock, launcher.sock
    run_dir: str = "/run/stockade"
    # one base port for a self-contained instance: gateway transparent = base, explicit proxy
    # = +1, DNS = +2, broker = +3, gateway metrics = +4, broker metrics = +5, dev OpenBao =
    # +6 (each still overridable); unset: the listeners' own defaults
    base_port: int | None = Field(None, ge=1, le=65536 - PORT_SPAN)
    # CA bundle (PEM) trusted for upstream TLS by the gateway's inspection and the broker,
    # where gateway.inspection.upstream_ca_file / broker.ca_file are unset
    upstream_ca_file: str | None = None

    if TYPE_CHECKING:  # every subclass has these sections (not fields of this class)
        events: EventSettings
        launcher: LauncherSettings

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        return derive(data)


class LauncherFile(Shared):
    """`stockade.yaml` with only the top-level keys, `events` and `launcher` validated;
    the other sections are kept as written (the commands that read them load `Config`)."""

    events: EventSettings = EventSettings()
    gateway: Any = None
    dns: Any = None
    broker: Any = None
    vault: Any = None
    launcher: LauncherSettings = LauncherSettings()
    dev_vault: Any = None
    stack: Any = None


def load_as(model: type[M], path: str | Path | None) -> M:
    """Load `stockade.yaml` as `model`; None gives the embedded defaults."""
    if path is None:
        return model()
    p = Path(path)
    return validate_as(model, read_mapping(p), p)


def validate_as(model: type[M], data: dict[Any, Any], p: Path) -> M:
    """`data` (the mapping read from `p`) as `model`; ConfigError lists every error."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = [
            f"{p}: {'.'.join(str(x) for x in err['loc'])}: {_message(err)}" for err in e.errors()
        ]
        raise ConfigError("\n".join(lines)) from None


def _message(err: Any) -> str:
    # a validator's own ValueError already says what is wrong; drop pydantic's "Value error, "
    if err["type"] == "value_error" and "error" in err.get("ctx", {}):
        return str(err["ctx"]["error"])
    return str(err["msg"])

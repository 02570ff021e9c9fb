"""Result types shared by the sniffers (`sniff_tls`, `sniff_http`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from stockade.policy.reasons import Reason


@dataclass(frozen=True, slots=True)
class NeedMore:
    """The sniffer needs more bytes before it can answer."""


NEED_MORE: Final = NeedMore()


@dataclass(frozen=True, slots=True)
class SniffError:
    reason: Reason  # the denial reason code
    detail: str  # short, for the event message; never contains payload bytes

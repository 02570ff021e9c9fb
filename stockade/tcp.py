"""TCP options of the listeners that sandboxes connect to (gateway, broker)."""

from __future__ import annotations

import logging
import socket
from typing import Any

# a kernel congestion-control name (TCP_CA_NAME_MAX is 16 with the NUL)
CONGESTION_CONTROL_NAME = r"^[a-z0-9_]{1,15}$"


def set_congestion_control(sock: Any, name: str | None, setting: str, log: logging.Logger) -> None:
    """Set `sock`'s TCP congestion control; on a listener, every connection it accepts
    from then on inherits it. An algorithm the kernel lacks (not built, not loaded) is
    reported and the system default kept: that is still a correct, only slower, choice."""
    if not name:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as e:
        log.warning("%s %r unavailable (%s): system default kept", setting, name, e)

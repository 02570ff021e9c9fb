"""`stockade broker serve` handles signals in one place, stockade.serving (handlers before
start-up, SIGHUP reload, stop() always; tests/broker/test_cli.py drives it with real
signals). BrokerService keeps no signal loop of its own that could drift from it."""

from __future__ import annotations

import inspect

from stockade.broker import service


def test_broker_service_has_no_signal_loop_of_its_own() -> None:
    assert not hasattr(service.BrokerService, "serve_forever")
    assert "add_signal_handler" not in inspect.getsource(service)

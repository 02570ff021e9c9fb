"""The components' config views (structural Protocols) ask only for what the composed
stockade.config.Config has: a view that drifts from the model fails here, not at start-up."""

import pytest
from stockade.broker.configview import BrokerConfig
from stockade.gateway.configview import GatewayConfig
from stockade.launcher.configview import LauncherConfig

from stockade.config import Config


@pytest.mark.parametrize("view", [GatewayConfig, BrokerConfig, LauncherConfig])
def test_config_has_every_attribute_a_view_reads(view: type) -> None:
    wanted = {n for n in vars(view) if not n.startswith("_")}
    assert wanted
    config = Config()
    assert {n for n in wanted if not hasattr(config, n)} == set()

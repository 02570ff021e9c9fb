"""The broker's rule file watch: a kubelet ConfigMap swap (`..data` renamed over) is a
reload, with the gateway's change detection; a bad rule set in a swap keeps the old rules.
The gateway's holder is checked on the same swaps (both components share the detection)."""

from __future__ import annotations

import json
import ssl
import uuid
from pathlib import Path

import pytest
from configmap_volume import project, tree
from polling import async_wait_until
from stockade.policy.holder import RulesHolder

from stockade.events import read_events
from stockade.testing.devvault import DevOpenBao

from .conftest import Upstream, write_rules
from .test_service_metrics import service

pytestmark = pytest.mark.vault

WATCHED = b"""\
profile: watched
description: added by a ConfigMap swap
egress:
  allow:
    - host: pypi.org
      ports: [443]
      id: watched-pypi
      reason: the one site this profile needs
"""


async def test_configmap_swap_reloads_the_broker(
    bao: DevOpenBao, upstream: Upstream, tls: tuple[ssl.SSLContext, str], tmp_path: Path
) -> None:
    staged = tmp_path / "staged"
    write_rules(staged, upstream.url, "stockade/watch-" + uuid.uuid4().hex[:8])
    files = tree(staged)
    volume = tmp_path / "rules"
    project(volume, files)
    token = tmp_path / "token"
    token.write_text(bao.root_token)
    svc = service(tmp_path, volume, bao.address, token, ca_file=tls[1], rules_poll_interval_s=0.05)
    holder = RulesHolder(volume, lambda _e: None)
    holder.load_initial()
    await svc.start()
    try:
        assert svc.broker is not None
        first = svc.broker.rules.version
        # a profile added in a swap: a new version without SIGHUP
        profile = "profiles/watched.yaml"
        files[profile] = WATCHED
        project(volume, files)
        assert holder.changed()
        await async_wait_until(lambda: svc.broker.rules.version != first, timeout=20,
                               what="the broker reloads after the swap")
        second = svc.broker.rules.version
        assert holder.reload("file_change")["version"] == second  # the gateway's agrees
        # a broken rule set in the next swap: refused, the second version stays in force
        project(volume, {**files, profile: b"profile: [unclosed\n"})
        await async_wait_until(
            lambda: any(e["event"]["action"] == "rules_reload"
                        and e["event"]["reason"] == "rules_invalid"
                        for e in read_events(tmp_path / "events.jsonl")),
            timeout=20, what="the refused reload's event")
        assert svc.broker.rules.version == second
    finally:
        await svc.stop()
    reloads = [e for e in read_events(tmp_path / "events.jsonl")
               if e["event"]["action"] == "rules_reload"]
    assert [e["event"]["reason"] for e in reloads] == ["rules_loaded", "rules_invalid"]
    assert all('"file_change"' in json.dumps(e) for e in reloads)  # the trigger: the watch

"""DevOpenBao: a real dev server that leaves no process behind."""

from __future__ import annotations

import os
from pathlib import Path

import hvac
import pytest

from stockade.testing.devvault import DevOpenBao

pytestmark = pytest.mark.vault


def test_start_put_read_stop_leaves_nothing() -> None:
    with DevOpenBao() as bao:
        assert bao.running and bao.address.startswith("http://127.0.0.1:")
        assert bao.put_secret("stockade/x", "token", "v1") == 1
        assert bao.put_secret("stockade/x", "token", "v2") == 2
        c = hvac.Client(url=bao.address, token=bao.root_token)
        got = c.secrets.kv.v2.read_secret_version(path="stockade/x", mount_point="secret",
                                                  raise_on_deleted_version=True)
        assert got["data"]["data"] == {"token": "v2"}
        assert bao.proc is not None
        pid = bao.proc.pid
        # the root token is not on the command line (visible to every local user in ps)
        assert bao.root_token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert not bao.running
    assert not os.path.exists(f"/proc/{pid}")
    with pytest.raises(Exception):  # noqa: B017 - connection refused: the server is gone
        hvac.Client(url=bao.address, timeout=2).sys.is_initialized()

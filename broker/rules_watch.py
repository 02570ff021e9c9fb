"""The broker's rule file watch: a changed rules directory is reloaded as SIGHUP would.

The change detection is the gateway's (`stockade.policy.holder.snapshot`: every file's
path, mtime and size), so both components see the same changes. It follows what the
kubelet does to a ConfigMap volume: the new files go into a fresh `..<timestamp>` directory
and the `..data` symlink is renamed over, so the listing changes in one step and a reload
reads the old tree or the new one through the symlinks, never a mix. A snapshot taken
mid-swap only costs one more reload of the same files.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stockade.policy.holder import Snapshot, snapshot

Reload = Callable[[str], Awaitable[dict[str, Any]]]


class RulesWatch:
    """`await poll()` on a timer: calls `reload("file_change")` when the files changed
    since the last look. The baseline is taken at construction, so build it before the
    first load of the rules (a change in between is then seen, not missed)."""

    def __init__(self, rules_dir: str | os.PathLike[str], reload: Reload) -> None:
        self.rules_dir = Path(rules_dir)
        self.reload = reload
        self._seen: Snapshot = snapshot(self.rules_dir)

    async def poll(self) -> bool:
        """True when a change was seen (and a reload run, whatever its outcome: a refused
        rule set is not retried until the files change again)."""
        now = await asyncio.to_thread(snapshot, self.rules_dir)
        if now == self._seen:
            return False
        self._seen = now
        await self.reload("file_change")
        return True

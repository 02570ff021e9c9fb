"""`with thing:` for the long-lived helpers that have `start()` and `stop()` (the fake
internet, a client namespace, the dev OpenBao, test upstreams): started on entry,
stopped on exit, whatever ended the block."""

from __future__ import annotations

from typing import Any, Self


class StartStop:
    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The mitmproxy internals the inspector wraps (gateway/inspector/patches.py) are named
with the mitmproxy version they were checked against: an upgrade must re-check them."""

from __future__ import annotations

import importlib

import mitmproxy.version
import pytest
from stockade.gateway.inspector import patches
from stockade.policy.reasons import Reason


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.target)
def test_each_patch_was_checked_against_the_installed_mitmproxy(patch: patches.Patch) -> None:
    series = patch.checked.removesuffix("x")  # "11.0.x": any 11.0 release
    assert patch.checked.endswith(".x")
    assert mitmproxy.version.VERSION.startswith(series), (
        f"{patch.target} was checked against mitmproxy {patch.checked}, installed is "
        f"{mitmproxy.version.VERSION}: re-check the wrapper, then update PATCHES"
    )


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.target)
def test_each_patched_target_exists(patch: patches.Patch) -> None:
    module, _, attribute = patch.target.partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)


def test_the_patches_are_named_once() -> None:
    targets = [p.target for p in patches.PATCHES]
    assert len(set(targets)) == len(targets)


def test_a_refusal_without_a_handed_over_flow_emits_nothing() -> None:
    state = patches.PatchState()
    state.refused(None, "no connection")  # no addon, no connection: nothing to name

    class Conn:
        id = "c1"

    events: list[tuple] = []

    class Addon:
        flows: dict = {}

        def _flow_event(self, *args: object) -> None:
            events.append(args)

    state.addon = Addon()  # type: ignore[assignment]
    state.refused(Conn(), "unknown connection")
    assert events == []
    Addon.flows["c1"] = "meta"
    state.refused(Conn(), "known")
    assert events == [("meta", Reason.PROTOCOL_UNRECOGNISED, "known")]


async def test_hooks_dispatched_from_the_kept_lookup_as_mitmproxy_would() -> None:
    """The hook dispatch patch: handlers run in chain order, an addon added or removed
    later is seen at the next hook, AddonHalt stops the rest, other hooks are unaffected."""
    from mitmproxy import exceptions
    from mitmproxy.proxy.layers.http import HttpRequestHeadersHook, HttpResponseHook
    from mitmproxy.test import taddons, tflow

    patches.install()
    calls: list[str] = []

    class Recorder:
        def __init__(self, name: str, halt: bool = False) -> None:
            self.name, self.halt = name, halt

        def requestheaders(self, flow: object) -> None:
            calls.append(self.name)
            if self.halt:
                raise exceptions.AddonHalt

    class Quiet:  # implements no request hook: never called for one
        name = "quiet"

    with taddons.context() as tctx:
        mgr = tctx.master.addons
        a, b, c = Recorder("a"), Recorder("b"), Recorder("c", halt=True)
        mgr.add(a, Quiet(), b)
        flow = tflow.tflow()
        await mgr.trigger_event(HttpRequestHeadersHook(flow))
        assert calls == ["a", "b"]
        await mgr.trigger_event(HttpResponseHook(flow))  # nobody: nothing called
        assert calls == ["a", "b"]
        mgr.remove(a)
        mgr.add(c, Recorder("d"))
        calls.clear()
        await mgr.trigger_event(HttpRequestHeadersHook(flow))
        assert calls == ["b", "c"]  # a is gone, c halts before d

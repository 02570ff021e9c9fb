"""Warm pools, the pure parts: shapes, refill plans, the settings, the init plan's split
into what no task decides and what its claim brings, and the pooled task's registration."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError
from stockade.launcher import initscript, poolplan
from stockade.launcher.poolplan import Shape
from stockade.launcher.settings import LauncherSettings, PoolSettings
from stockade.policy.model import Limits

from stockade.tasks import RegistryError, Task

A = Shape("netns", 1.0, 256 * 2**20, 64 * 2**20, 128)
B = Shape("gvisor", 1.0, 256 * 2**20, 64 * 2**20, 128)


def test_targets_and_shapes_from_settings() -> None:
    s = PoolSettings.model_validate({"targets": [
        {"isolation": "container", "size": 3, "memory_mib": 256, "disk_mib": 64,
         "pids": 128}]})
    assert poolplan.targets(s) == {A: 3}
    # a profile of the same limits (any TTL) claims from it; another shape does not
    assert poolplan.shape_of("netns", Limits(cpus=1, memory=256 * 2**20, disk=64 * 2**20,
                                             pids=128, ttl=5)) == A
    assert poolplan.shape_of("netns", Limits()) != A
    assert A.label() == "netns/cpus=1,mem=256Mi,disk=64Mi,pids=128"


def test_two_pools_of_one_shape_are_refused() -> None:
    t = {"isolation": "container", "size": 1}
    with pytest.raises(ValidationError, match="two pools of one tier and shape"):
        PoolSettings.model_validate({"targets": [t, {**t, "size": 2}]})
    with pytest.raises(ValidationError):
        PoolSettings.model_validate({"targets": [{"isolation": "container", "size": 0}]})
    assert LauncherSettings().pools.targets == []  # no pools unless configured


def test_refills_are_bounded_and_shared_between_pools() -> None:
    want = {A: 5, B: 2}
    assert poolplan.next_refills(want, {}, {}, 3) == [B, A, B]  # one per pool in turn
    assert poolplan.next_refills(want, {A: 5, B: 1}, {}, 3) == [B]
    assert poolplan.next_refills(want, {A: 2}, {A: 1, B: 2}, 3) == []  # 3 being made
    assert poolplan.next_refills(want, {A: 2}, {A: 1}, 4) == [B, A, B]
    assert poolplan.next_refills(want, {A: 5, B: 2}, {}, 8) == []  # full


def test_tiers_without_pooled_start_are_named() -> None:
    assert poolplan.unknown_tiers([A, B], ["netns"]) == ["gvisor"]
    assert poolplan.unknown_tiers([A], ["netns"]) == []


def _plan() -> initscript.InitPlan:
    return initscript.InitPlan(
        root="/sbx/r", scratch="/sbx/s", etc_dir="/sbx/e", uid=65534, gid=65534,
        system=(initscript.Bind("/usr", "/usr"),),
        inputs=(initscript.Bind("/host/data", "/inputs/data"),))


def test_pooled_plan_is_the_full_plan_split_at_the_inputs() -> None:
    plan = _plan()
    full = initscript.build(plan)["ops"]
    first = initscript.build_pooled(plan)["ops"]
    rest = initscript.claim_ops(plan)
    assert first + rest == full  # the same operations, in the same order
    # nothing of a task before the claim: no input, no pivot (the host tree still there)
    assert not [op for op in first if "/host/data" in op or op[0] == "pivot"]
    assert [op[0] for op in rest][-4:] == ["mkdir", "pivot", "remount_ro", "chdir"]
    assert ["bind", "/host/data", "/sbx/r/inputs/data", True, False] in rest
    # the pooled part does not depend on the inputs at all
    assert initscript.build_pooled(dataclasses.replace(plan, inputs=()))["ops"] == first


def test_pooled_task_registration() -> None:
    t = Task.from_dict({"task_id": "abc", "address": "10.0.0.2", "profile": "",
                        "pooled": True})
    assert t.pooled and t.profile == ""
    assert not Task.from_dict({"task_id": "a", "address": "10.0.0.2", "profile": "p"}).pooled
    with pytest.raises(RegistryError, match="no profile until it is claimed"):
        Task.from_dict({"task_id": "a", "address": "10.0.0.2", "profile": "p",
                        "pooled": True})
    with pytest.raises(RegistryError, match="true or false"):
        Task.from_dict({"task_id": "a", "address": "10.0.0.2", "profile": "",
                        "pooled": "yes"})

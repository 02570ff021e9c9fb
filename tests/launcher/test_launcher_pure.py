"""Pure parts of the launcher: address plan, exports decision, scrubbing, init script, state."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import threading
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from stockade.launcher import exports, initscript, scrub
from stockade.launcher.addresses import free_slot, pool_size, slot_addresses
from stockade.launcher.ending import end_due, end_event
from stockade.launcher.state import SandboxRecord, StateFile

from stockade.events import validate
from stockade.procs import same_process, start_time

# -- addresses ------------------------------------------------------------------------


def test_slots_are_disjoint_30s() -> None:
    a = slot_addresses("10.213.0.0/16", 0)
    b = slot_addresses("10.213.0.0/16", 1)
    assert (a.host_ip, a.guest_ip, b.host_ip, b.guest_ip) == (
        "10.213.0.1", "10.213.0.2", "10.213.0.5", "10.213.0.6")
    assert a.guest_mac == "02:00:0a:d5:00:02" and a.host_mac.startswith("02:01:")
    assert pool_size("10.213.0.0/16") == 16384
    with pytest.raises(ValueError):
        slot_addresses("10.213.0.0/30", 1)
    with pytest.raises(ValueError):
        pool_size("10.0.0.0/31")


@settings(deadline=None)
@given(st.sets(st.integers(0, 63), max_size=63))
def test_free_slot_is_lowest_unused(used: set[int]) -> None:
    s = free_slot("10.1.0.0/24", used)
    assert s not in used and all(i in used for i in range(s))


def test_pool_exhaustion_fails_closed() -> None:
    with pytest.raises(RuntimeError, match="exhausted"):
        free_slot("10.1.0.0/29", [0, 1])


@settings(deadline=None)
@given(st.integers(0, 1023), st.integers(0, 1023))
def test_distinct_slots_never_share_addresses(i: int, j: int) -> None:
    a, b = slot_addresses("10.8.0.0/20", i), slot_addresses("10.8.0.0/20", j)
    if i != j:
        assert {a.host_ip, a.guest_ip}.isdisjoint({b.host_ip, b.guest_ip})
        assert a.guest_mac != b.guest_mac
    assert ipaddress.ip_address(a.guest_ip) in ipaddress.ip_network("10.8.0.0/20")


# -- exports --------------------------------------------------------------------------


def test_sniff_by_content_not_name() -> None:
    assert exports.sniff(b'{"a": 1}') == "json"
    assert exports.sniff(b"[1, 2]\n") == "json"
    assert exports.sniff(b"{not json") == "text"
    assert exports.sniff("héllo\n".encode()) == "text"
    assert exports.sniff(b"\x7fELF\x02\x01\x01\x00\xff\xfe") is None
    assert exports.sniff(b"a\0b") is None
    assert exports.sniff(b"\x89PNG\r\n\x1a\n....") == "png"
    assert exports.sniff(bytes(257) + b"ustar\x0000") == "tar"


def test_decide_caps_and_types() -> None:
    c = [
        exports.Candidate("a.txt", 10, True, "text"),
        exports.Candidate("b.json", 20, True, "json"),
        exports.Candidate("big.txt", 2000, True, "text"),
        exports.Candidate("bin", 5, True, None),
        exports.Candidate("c.txt", 80, True, "text"),
        exports.Candidate("link", 5, False, None),
        exports.Candidate("img", 5, True, "png"),
    ]
    d = {x.name: x.why for x in exports.decide(c, 1000, 100, ("text",))}
    assert d == {"a.txt": "ok", "b.json": "ok", "big.txt": "too_large", "bin": "type_not_allowed",
                 "c.txt": "total_exceeded", "link": "not_regular", "img": "type_not_allowed"}
    d2 = {x.name: x.allowed for x in exports.decide(c, 1000, 10**6, ("json",))}
    assert d2["b.json"] and not d2["a.txt"]


@settings(deadline=None)
@given(st.binary(max_size=300))
def test_sniff_never_raises(data: bytes) -> None:
    kind = exports.sniff(data)
    if kind == "json":
        json.loads(data)


def test_scan_refuses_links_and_write_stays_inside(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "r.json").write_text('{"ok": true}')
    (out / "link").symlink_to("/etc/passwd")
    (out / "dirlink").symlink_to("/etc")
    cands, contents = exports.scan(str(out), 1000)
    by = {c.name: c for c in cands}
    assert by["sub/r.json"].kind == "json" and by["sub/r.json"].regular
    assert not by["link"].regular and not by["dirlink"].regular
    assert "link" not in contents
    dest = tmp_path / "dest"
    exports.write_export(str(dest), "sub/r.json", contents["sub/r.json"])
    assert (dest / "sub" / "r.json").read_text() == '{"ok": true}'
    with pytest.raises(ValueError):
        exports.write_export(str(dest), "../escape", b"x")


# -- scrubbing ------------------------------------------------------------------------


def test_scrub_replaces_everything_host_specific() -> None:
    s = scrub.build(
        host_paths=["/var/lib/stockade/sandboxes", "/home/alice"],
        host_env={"API_TOKEN": "s3cr3t-value-123", "SHORT": "ab", "PATH": "/usr/bin"},
        hostnames=["buildhost-7"],
        addresses=["10.213.0.1", "127.0.0.53", "0.0.0.0"],
    )
    text = ("at /var/lib/stockade/sandboxes/x and /home/alice/.ssh; token s3cr3t-value-123; "
            "host buildhost-7 (BUILDHOST-7.example); dns 127.0.0.53 gw 10.213.0.1 "
            "not 10.213.0.15; ab stays; /usr/bin stays")
    out = s(text)
    for secret in ("/var/lib/stockade", "/home/alice", "s3cr3t", "buildhost-7", "BUILDHOST-7",
                   "127.0.0.53", "10.213.0.1 "):
        assert secret not in out
    assert "<env:API_TOKEN>" in out and "<hostname>" in out and "<infra-address>" in out
    assert "10.213.0.15" in out and "ab stays" in out and "/usr/bin stays" in out


@settings(deadline=None)
@given(st.text(min_size=6, max_size=30), st.text(max_size=40), st.text(max_size=40))
def test_scrubbed_output_never_contains_an_env_value(value: str, a: str, b: str) -> None:
    # a value that is part of its own placeholder could be rebuilt by it; skip those
    assume("<" not in value and value not in "<env:SECRET>" and not scrub.is_public_path(value))
    s = scrub.build(host_env={"SECRET": value})
    assert value not in s(a + value + b)


def test_scrub_keeps_public_system_paths() -> None:
    """`/etc/ssl/certs` (SSL_CERT_DIR) and `/usr/lib` are the same on every host: they stay,
    while host-specific paths under public directories are still replaced."""
    scratch = "/tmp/stockade-abc/sbx"
    s = scrub.build(
        host_paths=[scratch, "/var/lib/stockade", "/", "/tmp", "/root", "/usr/local/share"],
        host_env={"SSL_CERT_DIR": "/etc/ssl/certs", "LD_LIBRARY_PATH": "/usr/lib:/lib64",
                  "XDG_DATA_DIRS": "/usr/local/share:/usr/share", "TMPDIR": "/tmp",
                  "STATE": "/var/lib/stockade/x", "WORK": "/tmp/job-7781"},
    )
    text = ("certs in /etc/ssl/certs, libs in /usr/lib and /lib64, data /usr/share, tmp /tmp, "
            f"home /root; scratch {scratch}/t1; state /var/lib/stockade/x; work /tmp/job-7781")
    out = s(text)
    assert out == ("certs in /etc/ssl/certs, libs in /usr/lib and /lib64, data /usr/share, "
                   "tmp /tmp, home /root; scratch <host-path>/t1; state <env:STATE>; "
                   "work <env:WORK>")


@pytest.mark.parametrize("value", ["/etc/ssl/certs", "/usr/lib", "/", "/tmp", "//usr//lib/",
                                   "/usr/local/share:/usr/share", "/proc/self", "/dev/shm",
                                   "/dev/null"])
def test_public_paths(value: str) -> None:
    assert scrub.is_public_path(value)


@pytest.mark.parametrize("value", ["/tmp/x", "/var/lib/stockade", "/home/alice", "usr/lib",
                                   "/usr/../home/alice", "/etc/./../srv",
                                   "/etc/ssl:/srv/data", "", ":", "/etcetera", "s3cr3t",
                                   "/dev/shm/stockade-run", "//dev//mqueue/job-1"])
def test_host_specific_paths(value: str) -> None:
    assert not scrub.is_public_path(value)


def test_a_run_dir_in_dev_shm_is_scrubbed() -> None:
    """/dev is a public tree, but /dev/shm is world-writable scratch like /tmp: a run or
    state dir there is the host's and never reaches the caller."""
    s = scrub.build(host_paths=["/dev/shm/stockade-7f3a/run"],
                    host_env={"STOCKADE_RUN": "/dev/shm/stockade-7f3a"})
    text = "sock /dev/shm/stockade-7f3a/run/gw.sock; dir /dev/shm/stockade-7f3a/x; /dev/null"
    assert s(text) == "sock <host-path>/gw.sock; dir <env:STOCKADE_RUN>/x; /dev/null"


# -- init script ----------------------------------------------------------------------


def test_init_plan_is_data_in_a_safe_order() -> None:
    evil = "/in/$(touch /pwned);`id`'\""
    plan = initscript.InitPlan(
        root="/r", scratch="/s", etc_dir="/e", uid=65534, gid=65534,
        system=(initscript.Bind("/usr", "/usr"), initscript.Bind("/bin", "/bin",
                                                                 symlink_to="usr/bin")),
        inputs=(initscript.Bind(evil, "/inputs/x y"),),
        cgroup_procs=("/sys/fs/cgroup/pids/stockade/abc/cgroup.procs",),
    )
    built = initscript.build(plan)
    assert json.loads(json.dumps(built)) == built  # plain JSON for the init's memfd
    ops = built["ops"]
    kinds = [op[0] for op in ops]
    # cgroups first (everything after is counted), IPv6 off before any mount
    assert ops[0] == ["cgroup", ["/sys/fs/cgroup/pids/stockade/abc/cgroup.procs"]]
    assert kinds.index("write") < kinds.index("mount")
    # values stay values: the evil path is one argument of one read-only bind
    binds = [op for op in ops if op[0] == "bind" and op[1] == evil]
    assert binds == [["bind", evil, "/r/inputs/x y", True, False]]
    assert ["symlink", "usr/bin", "/r/bin"] in ops
    assert ["bind", "/usr", "/r/usr", True, False] in ops
    # scratch and /tmp are the only writable binds of host directories
    rw = [op[1] for op in ops if op[0] == "bind" and not op[3] and not op[1].startswith("/dev/")]
    assert rw == ["/s", "/s/tmp"]
    # pivot, then the root read-only, and nothing mounted after that
    assert kinds[-3:] == ["pivot", "remount_ro", "chdir"]
    assert ops[-2] == ["remount_ro", "/", initscript.MS_NOSUID | initscript.MS_NODEV]
    assert (built["uid"], built["gid"]) == (65534, 65534)


def test_init_plan_builds_a_minimal_etc() -> None:
    plan = initscript.InitPlan(
        root="/r", scratch="/s", etc_dir="/e", uid=65534, gid=65534,
        etc=(initscript.Bind("/etc/ssl/certs", "/etc/ssl/certs"),
             initscript.Bind("/etc/localtime", "/etc/localtime", symlink_to="/usr/z/UTC"),
             initscript.Bind("/etc/hosts", "/etc/hosts", is_dir=False),  # a glob hit: skipped
             initscript.Bind("/etc/mime.types", "/etc/mime.types", is_dir=False)),
    )
    ops = initscript.build(plan)["ops"]
    # /etc is a directory of the root tmpfs, never a bind of the host's
    assert ["mkdir", "/r/etc", 0o755] in ops
    assert not any(op[0] == "bind" and op[1] == "/etc" for op in ops)
    for name in initscript.GENERATED_ETC:
        i = ops.index(["touch", f"/r/etc/{name}"])
        assert ops[i + 1] == ["bind", f"/e/{name}", f"/r/etc/{name}", True, False]
    assert ["bind", "/etc/ssl/certs", "/r/etc/ssl/certs", True, False] in ops
    assert ["symlink", "/usr/z/UTC", "/r/etc/localtime"] in ops
    assert ["bind", "/etc/mime.types", "/r/etc/mime.types", True, False] in ops
    assert not any(op[0] == "bind" and op[1] == "/etc/hosts" for op in ops)
    # every bind into /etc is read-only
    assert all(op[3] for op in ops if op[0] == "bind" and op[2].startswith("/r/etc"))
    with pytest.raises(ValueError):
        initscript.build(dataclasses.replace(plan, etc=(initscript.Bind("/x", "/usr/x"),)))


def test_init_plan_binds_the_trust_bundle_over_the_system_one() -> None:
    plan = initscript.InitPlan(
        root="/r", scratch="/s", etc_dir="/e", uid=65534, gid=65534,
        etc_files=(*initscript.GENERATED_ETC, "stockade-ca-bundle.pem"),
        etc=(initscript.Bind("/etc/ssl/certs", "/etc/ssl/certs"),),
        etc_over=(("stockade-ca-bundle.pem", "ssl/certs/ca-certificates.crt"),),
    )
    ops = initscript.build(plan)["ops"]
    over = ["bind", "/e/stockade-ca-bundle.pem", "/r/etc/ssl/certs/ca-certificates.crt",
            True, True]  # read-only, and only where the allowlisted file exists
    # after the directory it lands in, and never a file the init would have to create
    assert ops.index(over) > ops.index(["bind", "/etc/ssl/certs", "/r/etc/ssl/certs", True, False])
    assert ["touch", "/r/etc/ssl/certs/ca-certificates.crt"] not in ops
    assert ["bind", "/e/stockade-ca-bundle.pem", "/r/etc/stockade-ca-bundle.pem", True,
            False] in ops
    with pytest.raises(ValueError):
        initscript.build(dataclasses.replace(plan, etc_over=(("b", "../x"),)))


def test_init_plan_with_host_etc_overlays_only() -> None:
    """ro_binds listing /etc: the old behaviour, the launcher's files over the host's."""
    plan = initscript.InitPlan(root="/r", scratch="/s", etc_dir="/e", uid=1, gid=1,
                               system=(initscript.Bind("/etc", "/etc"),), host_etc=True,
                               etc_files=initscript.HOST_ETC_OVERLAY)
    ops = initscript.build(plan)["ops"]
    assert ["bind", "/etc", "/r/etc", True, False] in ops
    assert [op for op in ops if op[0] == "bind" and op[1].startswith("/e/")] == [
        ["bind", f"/e/{n}", f"/r/etc/{n}", True, True] for n in initscript.HOST_ETC_OVERLAY]
    assert ops.count(["mkdir", "/r/etc", 0o755]) == 1  # the bind's mount point only


def test_init_plan_congestion_control_is_optional_and_best_effort() -> None:
    plan = initscript.InitPlan(root="/r", scratch="/s", etc_dir="/e", uid=1, gid=1)
    cc_path = "/r/proc/sys/net/ipv4/tcp_congestion_control"
    assert not [op for op in initscript.build(plan)["ops"] if op[1:2] == [cc_path]]
    ops = initscript.build(dataclasses.replace(plan, congestion_control="cubic"))["ops"]
    assert [op for op in ops if op[1:2] == [cc_path]] == [["write", cc_path, "cubic", True]]


def test_init_plan_sysctls_go_through_the_inits_own_procfs() -> None:
    """In a container the inherited /proc/sys is read-only: every sysctl the init writes
    is under the fresh procfs it mounts itself, after that mount."""
    plan = initscript.InitPlan(root="/r", scratch="/s", etc_dir="/e", uid=1, gid=1,
                               congestion_control="bbr")
    ops = initscript.build(plan)["ops"]
    mount = ops.index(["mount", "proc", "/r/proc", "proc", initscript.MS_NOSUID
                       | initscript.MS_NODEV | initscript.MS_NOEXEC, None])
    writes = [(i, op[1]) for i, op in enumerate(ops) if op[0] == "write"]
    sysctls = [(i, path) for i, path in writes if "/sys/" in path]
    assert {p.rsplit("/", 1)[1] for _, p in sysctls} == {
        "disable_ipv6", "ping_group_range", "tcp_congestion_control", "hostname"}
    assert all(i > mount and p.startswith("/r/proc/sys/") for i, p in sysctls), sysctls
    assert not [p for _, p in writes if p.startswith("/proc/sys")]


def test_generated_etc_content() -> None:
    c = initscript.etc_content("10.213.0.1", "sandbox", 65534, 65534)
    assert set(c) == set(initscript.GENERATED_ETC)
    assert c["resolv.conf"] == "nameserver 10.213.0.1\noptions timeout:2\n"
    assert c["hostname"] == "sandbox\n"
    assert "127.0.1.1\tsandbox" in c["hosts"]
    assert c["passwd"] == ("root:x:0:0:root:/root:/bin/sh\n"
                           "nobody:x:65534:65534:nobody:/scratch/home:/bin/sh\n")
    assert c["group"] == "root:x:0:\nnogroup:x:65534:\n"
    lookups = dict(line.split(":", 1) for line in c["nsswitch.conf"].splitlines())
    assert lookups["passwd"].split() == lookups["group"].split() == ["files"]
    assert lookups["hosts"].split() == ["files", "dns"]
    assert all(set(v.split()) <= {"files", "dns"} for v in lookups.values())
    other = initscript.etc_content("10.0.0.1", "box", 1000, 1001)
    assert [line.split(":")[:4] for line in other["passwd"].splitlines()] == [
        ["root", "x", "0", "0"], ["sandbox", "x", "1000", "1001"],
        ["nobody", "x", "65534", "65534"]]
    assert other["group"] == "root:x:0:\nsandbox:x:1001:\nnogroup:x:65534:\n"
    assert other == initscript.etc_content("10.0.0.1", "box", 1000, 1001)  # pure


@pytest.mark.parametrize("bad", ["/etc/ssl", "../shadow", "ssl/../shadow", "", ".", "a//b",
                                 "passwd", "hosts", "resolv.conf/x", "nsswitch.conf"])
def test_etc_allowlist_entries_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        initscript.check_etc_entry(bad)


def test_etc_allowlist_entries_ok() -> None:
    assert initscript.check_etc_entry("ssl/certs/") == "ssl/certs"
    assert initscript.check_etc_entry("python3*") == "python3*"
    assert initscript.check_etc_entry("host.conf") == "host.conf"
    from stockade.launcher.settings import LauncherSettings

    assert "/etc" not in LauncherSettings().ro_binds
    with pytest.raises(ValueError, match="generates"):
        LauncherSettings(etc_allowlist=["passwd"])


_segment = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
                  min_size=1, max_size=12).filter(lambda x: x not in (".", ".."))


@settings(deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=40), st.lists(_segment, min_size=1,
                                                                    max_size=3)),
                max_size=4))
def test_init_plan_binds_each_input_verbatim_read_only(
        inputs: list[tuple[str, list[str]]]) -> None:
    binds = []
    for host, segs in inputs:
        guest = "/in/" + "/".join(segs)
        binds.append(initscript.Bind("/h/" + host, guest))
    plan = initscript.InitPlan(root="/r", scratch="/s", etc_dir="/e", uid=1000, gid=1000,
                               inputs=tuple(binds))
    ops = initscript.build(plan)["ops"]
    for b in binds:
        assert ["bind", b.source, "/r" + b.target, True, False] in ops
        # checked before its mount point is created
        checked = [(op[1], ops[j + 2]) for j, op in enumerate(ops) if op[0] == "confined"]
        assert ("/r" + b.target, ["bind", b.source, "/r" + b.target, True, False]) in checked
    assert initscript.build(plan) == initscript.build(plan)  # pure


@pytest.mark.parametrize("bad", ["relative", "/scratch", "/scratch/x", "/proc", "/dev/x",
                                 "/a/../b", "/", "/tmp/x", "/sys/x",
                                 # what the guest's (or the netns) init runs as root with
                                 "/sbx", "/sbx/cfg", "/init", "/usr", "/usr/bin",
                                 "/usr/lib/python3.11", "/bin", "/sbin/x", "/lib",
                                 "/lib64/ld-linux-x86-64.so.2", "/lib32", "/etc",
                                 "/etc/ld.so.preload"])
def test_input_targets_cannot_shadow_sandbox_mounts(bad: str) -> None:
    with pytest.raises(ValueError):
        initscript.check_input_target(bad)


def test_input_target_ok() -> None:
    assert initscript.check_input_target("/inputs/data/") == "/inputs/data"
    for ok in ("/usrx", "/sbxdata", "/etcetera/x", "/opt/x"):
        assert initscript.check_input_target(ok) == ok
    # the configured ro_binds are reserved too
    with pytest.raises(ValueError, match="/opt"):
        initscript.check_input_target("/opt/x", extra=["/opt/"])


# -- state ----------------------------------------------------------------------------


def _rec(tid: str, slot: int) -> SandboxRecord:
    return SandboxRecord(tid, "p", slot, f"stk{tid}", f"stk-{tid}", "10.0.0.1", "10.0.0.2",
                         "02:00:00:00:00:02")


def test_state_roundtrip_and_concurrent_updates(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "s.json")

    def add(i: int) -> None:
        with sf.locked() as recs:
            recs[f"{i:010x}"] = _rec(f"{i:010x}", i)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = sf.read()
    assert sorted(r.slot for r in got.values()) == list(range(20))
    (tmp_path / "s.json").write_text("{torn")
    assert sf.read() == {}
    assert not any(n.startswith(".launcher.") for n in os.listdir(tmp_path))


def test_congestion_control_must_be_permitted_in_a_netns(caplog: pytest.LogCaptureFixture) -> None:
    from stockade.launcher.environment import permitted_congestion_control as permitted

    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    assert permitted(None) is None and permitted("reno") == "reno"
    for name in allowed:
        assert permitted(name) == name
    with caplog.at_level(logging.WARNING, logger="stockade.launcher"):
        assert permitted("nosuchcc") is None
    assert "'nosuchcc' is not in net.ipv4.tcp_allowed_congestion_control" in caplog.text


def test_the_scratch_root_is_made_private_even_when_it_exists(tmp_path: Path) -> None:
    """No path may lead from one sandbox (QEMU runs as sandbox_uid without a chroot) to
    another's scratch: the root is 0700, tightened when an operator made it 0755."""
    from stockade.launcher import mounts

    fresh = tmp_path / "a" / "sandboxes"
    mounts.private_dir(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    lax = tmp_path / "lax"
    lax.mkdir(mode=0o755)
    lax.chmod(0o755)
    mounts.private_dir(lax)
    assert lax.stat().st_mode & 0o777 == 0o700


# -- end events and owners ------------------------------------------------------------------
def _record(state: str = "running") -> SandboxRecord:
    return SandboxRecord(task_id="0123456789", profile="p", slot=1, ifname="stk0123456789",
                         netns="stk-0123456789", host_ip="10.213.0.1", guest_ip="10.213.0.2",
                         guest_mac="02:00:00:00:00:02", started_at=1000.0, state=state)


def test_end_event_is_owed_only_for_a_started_sandbox() -> None:
    assert end_due(_record("running")) and end_due(_record("frozen"))
    assert not end_due(_record("starting")) and not end_due(None)


def test_end_event_of_an_orphan() -> None:
    ev = end_event(_record(), "orphaned", now=1012.5)
    validate(ev)
    assert ev["stockade"]["lifecycle"] == "end" and ev["stockade"]["ended_by"] == "orphaned"
    assert ev["event"]["duration"] == 12_500_000_000 and "process" not in ev
    assert ev["labels"]["task_id"] == "0123456789"
    ev = end_event(_record(), "ttl", exit_code=137, duration_s=3.0, now=2000.0)
    assert (ev["event"]["reason"], ev["process"]["exit_code"]) == ("ttl_expired", 137)


def test_owner_is_one_process_not_one_pid() -> None:
    me = start_time(os.getpid())
    assert me is not None and same_process(os.getpid(), me)
    assert not same_process(os.getpid(), me + 1)  # another process that had this pid
    assert same_process(os.getpid(), 0)  # records from before owner_start: pid only
    rec = dataclasses.replace(_record(), owner_pid=os.getpid(), owner_start=me + 1)
    assert not rec.owner_alive()
    assert start_time(2**22 + 1) is None and not same_process(2**22 + 1, 0)


@given(st.text(max_size=60), st.sampled_from(scrub.PUBLIC_TREES),
       st.lists(st.from_regex(r"[a-z0-9._-]{1,8}", fullmatch=True).filter(
           lambda p: p not in (".", "..")), max_size=4))
def test_public_paths_survive_scrubbing(noise: str, tree: str, parts: list[str]) -> None:
    scrub.is_public_path(noise)  # never raises on any text
    path = "/".join([tree, *parts])
    assert scrub.is_public_path(path)
    s = scrub.build(host_paths=[path], host_env={"SOME_DIR": path})
    assert s(f"see {path} here") == f"see {path} here"


@pytest.mark.parametrize(("pattern", "good"),
                         [("TASK_ID_RE", "0123456789"), ("ENV_NAME_RE", "HOME")])
def test_name_patterns_refuse_a_trailing_newline(pattern: str, good: str) -> None:
    """re's "$" also matches before a final "\\n": the patterns end in \\Z instead."""
    import stockade.launcher.spec as spec

    rx = getattr(spec, pattern)
    assert rx.match(good)
    assert not rx.match(good + "\n")

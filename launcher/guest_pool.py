"""A pooled microVM guest's wait for its claim (the guest side of `microvm.pooled_plan` and
`plan_frame`), loaded by guest_init.py from the pooled plan's modules: builtins only, no
launcher import. `init` is guest_init.py itself (the guest's `__main__`), whose steps a
cold start's guest runs from its plan; here they run before any task exists, with what
the pooled plan says every task of the pool runs under (`ahead`).
"""

import marshal
import os

POOLED_READY = b"stockade-pooled-ready\n"  # microvm.POOLED_READY
MAX_PLAN_BYTES = 16 * 2**20  # microvm.MAX_PLAN_BYTES


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise OSError("the launcher closed the agent port")
        buf += chunk
    return bytes(buf)


def claimed(init, pooled, out_fd, err_fd):
    """Load what the claim's start would (`libc`), take the slot's fresh identity and
    network, put in force what every task of the pool runs under, say so on the agent
    port (root's alone), then wait there for the task's plan: a 4-byte big-endian length
    and the marshal bytes (microvm.plan_frame; its inputs' bytes too: guest_inputs.py),
    checked against this guest's (`check`). (The task's plan, the open agent port, the
    command's cgroup, its child.)"""
    init.libc()  # what the claim's start would load (become, load_filter, refresh)
    # its slot's identity and network, known before any task: a claim spawns no `ip`
    # (each spawn forks the init's Python under emulation); the services deny the
    # address as unclaimed until the claim, and nothing here sends
    init.refresh(pooled["fresh"])
    init.network(pooled["net"])
    # what every task of its pool runs under (the names, the cgroup's limits, the user)
    ahead = pooled["ahead"]
    init.sysctls(ahead)
    # the command's cgroup and its process, forked and waiting on a pipe for the plan: a
    # claim forks nothing (a fork of the init's Python and the cgroup's controllers cost
    # 10-50 ms under emulation); it is given the plan once the inputs are in place
    cg = init.limit_cgroup(init.make_cgroup(), ahead)
    command = init.fork_child(None, cg, (out_fd, err_fd), ahead=ahead)
    port = init.agent_port()
    os.write(port, POOLED_READY)
    n = int.from_bytes(read_exact(port, 4), "big")
    if n > MAX_PLAN_BYTES:
        raise OSError("the plan on the agent port is too large")
    plan = marshal.loads(read_exact(port, n))  # noqa: S302 - the launcher's
    check(pooled, plan)
    return plan, port, cg, command


def check(pooled, plan):
    """OSError unless `plan` is for this guest's address and MAC and asks for exactly what
    was put in force ahead: no command runs under other limits than its plan's."""
    if (plan["net"], plan["fresh"]["mac"]) != (pooled["net"], pooled["fresh"]["mac"]):
        raise OSError("the plan is not for this pooled guest's address")
    if {k: plan.get(k) for k in pooled["ahead"]} != pooled["ahead"]:
        raise OSError("the plan's user, rlimits or limits are not this pooled guest's")

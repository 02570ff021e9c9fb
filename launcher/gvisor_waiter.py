"""The first process of a gVisor warm-pool sandbox (runs inside gVisor, as the sandbox's
unprivileged user, from `python3 -I -S -c`; stdlib only).

Its sandbox is fully set up by runsc when it starts (root, /etc, scratch, limits, the
netns); it writes `READY` on stdout, then reads its claim from stdin: 8 bytes of length,
then a marshal dict of the task's `argv` and `env`, and execs the command in its place
(pid 1 of the sandbox, stdin, stdout and stderr the task's). EOF before a claim (the pool
was drained, or its launcher died) ends it, and with it the sandbox.
"""

import marshal
import os

READY = b"\0stockade-ready\n"


def read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            os._exit(0)
        buf += chunk
    return buf


def main():
    os.write(1, READY)
    claim = marshal.loads(read_exact(int.from_bytes(read_exact(8), "big")))  # noqa: S302
    argv, env = claim["argv"], claim["env"]
    try:
        os.execvpe(argv[0], argv, env)  # noqa: S606 - no shell on purpose
    except OSError as e:
        os.write(2, f"stockade: {argv[0]}: {e.strerror or e}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    main()

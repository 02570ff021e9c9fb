#!/usr/bin/env python3
"""A scripted agent loop on the Stockade SDK (no model needed).

What an coding agent does, in one session (one sandbox, kept between steps):
  1. writes a module and its tests into the sandbox,
  2. runs the tests, which fail,
  3. reads the failure, patches the module, reruns: the tests pass,
  4. tries to upload the work to a host its profile does not allow: the fence denies
     it, and the exec's result says so (reason and destination).
The session is killed when the `with` block ends, error or not.

    python3 examples/agent_loop.py --profile python            # the launcher's socket
    python3 examples/agent_loop.py --launcher https://host:8443 --token-file tok ...

Needs a running launcher service (`stockade up`, or `stockade launcher serve`). Exit
status 0 when every step went as described, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
import uuid

from stockade.client import ExecResult, Sandbox, denial_summary

MODULE = '''\
def mean(xs):
    """The arithmetic mean of a non-empty list."""
    return sum(xs) / (len(xs) - 1)
'''

TESTS = '''\
import unittest

from stats import mean


class MeanTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([2, 4, 6]), 4)

    def test_single(self):
        self.assertEqual(mean([5]), 5)


if __name__ == "__main__":
    unittest.main()
'''

UPLOAD = '''\
import sys, urllib.request
req = urllib.request.Request(sys.argv[1], data=open("stats.py", "rb").read(), method="POST")
try:
    urllib.request.urlopen(req, timeout=10)
    print("upload went through")
except Exception as e:
    print("upload refused:", type(e).__name__, e)
    sys.exit(3)
'''


def say(text: str) -> None:
    print(f"[agent] {text}", flush=True)


def run_tests(sb: Sandbox) -> ExecResult:
    res = sb.exec(["python3", "-m", "unittest", "-v", "test_stats"], timeout_s=60)
    say(f"tests: exit {res.exit_code} ({res.ended_by})")
    return res


def fix_from_failure(module: str, failure: str) -> str:
    """The 'model': reads the traceback, finds the off-by-one divisor it points at."""
    if "ZeroDivisionError" in failure or re.search(r"AssertionError: [\d.]+ != \d+", failure):
        return module.replace("(len(xs) - 1)", "len(xs)")
    raise SystemExit(f"[agent] cannot make sense of the failure:\n{failure}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a profile of the launcher's rules")
    ap.add_argument("--launcher", help="socket path or http(s):// URL (default: "
                                       "$STOCKADE_LAUNCHER, else the launcher's socket)")
    ap.add_argument("--token-file", help="bearer token for a launcher URL")
    ap.add_argument("--upload-url", default="https://upload.pypi.org/legacy/",
                    help="where the agent tries to push its work (denied by the profile)")
    args = ap.parse_args(argv)
    labels = {"agent": "agent-loop-example", "run": uuid.uuid4().hex[:12]}
    endpoint = {"token_file": args.token_file} if args.token_file else {}
    with Sandbox.create(profile=args.profile, labels=labels, launcher=args.launcher,
                        **endpoint) as sb:
        say(f"session {sb.id} ({sb.info.isolation}), labels {labels}")
        sb.files.write("stats.py", MODULE)
        sb.files.write("test_stats.py", TESTS)
        say("wrote " + ", ".join(e.name for e in sb.files.list() if e.type == "file"))

        first = run_tests(sb)
        if first.ok:
            say("the tests passed before the fix: the example's bug is gone?")
            return 1
        say("reading the failure:\n" + first.stderr.strip().splitlines()[-1])
        fixed = fix_from_failure(sb.files.read_text("stats.py"), first.stderr)
        sb.files.write("stats.py", fixed)
        say("patched stats.py")

        second = run_tests(sb)
        if not second.ok:
            say("still failing:\n" + second.stderr)
            return 1

        sb.files.write("upload.py", UPLOAD)
        push = sb.exec(["python3", "upload.py", args.upload_url], timeout_s=60)
        say(push.stdout.strip() or push.stderr.strip())
        for line in denial_summary(push.denials):
            say(line)
        if push.exit_code == 0 or not push.denials:
            say("the upload was not denied")
            return 1
    say("done: tests pass, the upload was denied, the session is gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())

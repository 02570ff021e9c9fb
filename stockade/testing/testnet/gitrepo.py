"""The fake internet's git repository: a small bare repository built at start-up.

The history is described as data (`DEMO_COMMITS`) and written with `git fast-import`
from a stream `fast_import_stream` builds (pure), with fixed author dates, so every run
serves the same commit ids. `git` is a bootstrap dependency; nothing here needs a
network.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEMO_REPO = "demo.git"  # served as https://git.test/demo.git (and any *.git.test)
DEMO_BRANCH = "main"
DEMO_TAG = "v1.0"  # a lightweight tag on the first commit
_IDENT = "Stockade Fake Internet <git@git.test>"
_EPOCH = 1_700_000_000  # fixed dates: the same commit ids on every run


@dataclass(frozen=True)
class Commit:
    message: str
    files: Mapping[str, str]  # the whole tree of this commit: path -> text


DEMO_COMMITS: tuple[Commit, ...] = (
    Commit("Add the README", {"README.md": "# demo\n\nA repository of the fake internet.\n"}),
    Commit(
        "Add hello.py",
        {
            "README.md": "# demo\n\nA repository of the fake internet.\n",
            "hello.py": 'print("hello from git.test")\n',
        },
    ),
)


def _data(text: str) -> bytes:
    raw = text.encode()
    return b"data %d\n" % len(raw) + raw + b"\n"


def fast_import_stream(
    commits: Sequence[Commit], branch: str = DEMO_BRANCH, tag: str | None = DEMO_TAG
) -> bytes:
    """A `git fast-import` stream: `commits` in order on `branch`, `tag` on the first."""
    if not commits:
        raise ValueError("a repository needs at least one commit")
    out = []
    for i, c in enumerate(commits, start=1):
        when = f"{_EPOCH + 60 * i} +0000"
        out.append(f"commit refs/heads/{branch}\nmark :{i}\n".encode())
        out.append(f"author {_IDENT} {when}\ncommitter {_IDENT} {when}\n".encode())
        out.append(_data(c.message))
        if i > 1:
            out.append(f"from :{i - 1}\n".encode())
        out.append(b"deleteall\n")  # `files` is the whole tree, not a change set
        for path, text in sorted(c.files.items()):
            out.append(f"M 100644 inline {path}\n".encode() + _data(text))
        out.append(b"\n")
    if tag is not None:
        out.append(f"reset refs/tags/{tag}\nfrom :1\n\n".encode())
    return b"".join(out)


def git_env(home: Path) -> dict[str, str]:
    """Environment for server-side git: nothing of the host's (config, proxies, GIT_*)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "LC_ALL": "C",
    }


def create_demo_repo(root: Path) -> Path:
    """Build `root/demo.git` (bare, read-only over HTTP) and return its path."""
    repo = root / DEMO_REPO
    env = git_env(root)

    def git(*args: str, stdin: bytes | None = None) -> None:
        r = subprocess.run(
            ["git", *args], input=stdin, env=env, capture_output=True, check=False, timeout=60
        )
        if r.returncode != 0:
            raise RuntimeError(f"git {args[0]} failed: {r.stderr.decode(errors='replace')}")

    root.mkdir(parents=True, exist_ok=True)
    git("init", "--quiet", "--bare", f"--initial-branch={DEMO_BRANCH}", str(repo))
    git("-C", str(repo), "fast-import", "--quiet", stdin=fast_import_stream(DEMO_COMMITS))
    git("-C", str(repo), "config", "http.receivepack", "false")  # nobody pushes to it
    return repo

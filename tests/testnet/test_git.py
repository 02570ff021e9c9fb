"""git.test: the demo repository and the smart-HTTP bridge to `git http-backend`.

Pure tests of the CGI environment and head parsing; the repository built with real git;
real git clients against the site on 127.0.0.1 (aiohttp test server, no namespace).
"""

from __future__ import annotations

import asyncio
import gzip
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from stockade.testing.testnet.githttp import cgi_environ, parse_cgi_head
from stockade.testing.testnet.gitrepo import (
    DEMO_BRANCH,
    DEMO_COMMITS,
    DEMO_REPO,
    DEMO_TAG,
    create_demo_repo,
    fast_import_stream,
    git_env,
)
from stockade.testing.testnet.web import make_app


def git(*args: str, cwd: Path | None = None) -> str:
    r = subprocess.run(
        ["git", *args], cwd=cwd, env=git_env(cwd or Path("/tmp")),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


async def agit(home: Path, *args: str) -> tuple[int, str, str]:
    """A git client run without blocking the loop that serves the test site."""
    proc = await asyncio.create_subprocess_exec(
        "git", *args, cwd=home, env=git_env(home) | {"GIT_TERMINAL_PROMPT": "0"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def pkt(line: str) -> bytes:
    return f"{len(line) + 4:04x}{line}".encode()


# -- pure -------------------------------------------------------------------------------


def test_fast_import_stream_describes_whole_trees_in_order() -> None:
    stream = fast_import_stream(DEMO_COMMITS).decode()
    assert stream.count("commit refs/heads/main\n") == len(DEMO_COMMITS)
    assert stream.count("deleteall\n") == len(DEMO_COMMITS)
    assert "from :1\n" in stream and "reset refs/tags/v1.0\nfrom :1\n" in stream
    with pytest.raises(ValueError):
        fast_import_stream([])


def test_cgi_environ_carries_the_request() -> None:
    env = cgi_environ(
        method="POST",
        path_info="/demo.git/git-upload-pack",
        query="",
        headers={
            "Content-Type": "application/x-git-upload-pack-request",
            "Content-Length": "52",
            "Git-Protocol": "version=2",
            "User-Agent": "git/2.39",
            "Proxy": "http://evil.test/",  # httpoxy: must not become HTTP_PROXY
            "Authorization": "Basic eDp5",
        },
        project_root="/srv/git",
        remote_addr="10.0.0.9",
        body_decoded=False,
    )
    assert env["GIT_PROJECT_ROOT"] == "/srv/git" and env["GIT_HTTP_EXPORT_ALL"] == "1"
    assert (env["REQUEST_METHOD"], env["PATH_INFO"]) == ("POST", "/demo.git/git-upload-pack")
    assert env["CONTENT_TYPE"] == "application/x-git-upload-pack-request"
    assert env["CONTENT_LENGTH"] == "52"
    assert env["GIT_PROTOCOL"] == env["HTTP_GIT_PROTOCOL"] == "version=2"
    assert env["HTTP_USER_AGENT"] == "git/2.39"
    assert "HTTP_PROXY" not in env and "HTTP_AUTHORIZATION" not in env
    assert "HTTP_CONTENT_TYPE" not in env and "HTTP_CONTENT_LENGTH" not in env


def test_cgi_environ_of_a_decoded_body_has_no_encoding_or_length() -> None:
    """aiohttp already gunzipped the body: the backend must neither gunzip it again nor
    trust the wire length; it reads to end of file."""
    env = cgi_environ(
        method="POST", path_info="/demo.git/git-upload-pack", query="",
        headers={"Content-Encoding": "gzip", "Content-Length": "40"},
        project_root="/srv/git", remote_addr="", body_decoded=True,
    )  # fmt: skip
    assert "HTTP_CONTENT_ENCODING" not in env and "CONTENT_LENGTH" not in env


def test_parse_cgi_head() -> None:
    status, headers = parse_cgi_head(
        b"Status: 404 Not Found\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
    )
    assert status == 404
    assert dict(headers) == {"Content-Type": "text/plain"}  # aiohttp frames the body
    assert parse_cgi_head(b"Expires: Fri, 01 Jan 1980 00:00:00 GMT\n")[0] == 200
    with pytest.raises(ValueError):
        parse_cgi_head(b"no colon here\r\n")


# -- the repository -----------------------------------------------------------------------


def test_demo_repo_has_the_described_history(tmp_path: Path) -> None:
    repo = create_demo_repo(tmp_path / "a")
    assert repo.name == DEMO_REPO
    assert git("--git-dir", str(repo), "rev-parse", "--is-bare-repository") == "true"
    subjects = git("--git-dir", str(repo), "log", "--format=%s", DEMO_BRANCH).splitlines()
    assert subjects == [c.message for c in reversed(DEMO_COMMITS)]
    root = git("--git-dir", str(repo), "rev-list", "--max-parents=0", DEMO_BRANCH)
    assert git("--git-dir", str(repo), "rev-parse", DEMO_TAG) == root
    for path, text in DEMO_COMMITS[-1].files.items():
        assert git("--git-dir", str(repo), "show", f"{DEMO_BRANCH}:{path}") == text.strip()
    # fixed dates: every fake internet serves the same commit ids
    again = create_demo_repo(tmp_path / "b")
    assert git("--git-dir", str(again), "rev-parse", DEMO_BRANCH) == git(
        "--git-dir", str(repo), "rev-parse", DEMO_BRANCH
    )


# -- the site -------------------------------------------------------------------------------


@pytest.fixture
async def git_site(tmp_path: Path) -> AsyncIterator[tuple[TestClient, Path]]:
    root = tmp_path / "srv"
    create_demo_repo(root)
    client = TestClient(TestServer(make_app("git.test", git_root=str(root)), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client, root
    finally:
        await client.close()


def test_git_site_needs_a_root() -> None:
    with pytest.raises(ValueError):
        make_app("git.test")


@pytest.mark.parametrize("version", ["0", "2"])
async def test_clone_ls_remote_and_fetch_over_smart_http(
    git_site: tuple[TestClient, Path], tmp_path: Path, version: str
) -> None:
    client, root = git_site
    url = str(client.make_url(f"/{DEMO_REPO}"))
    served = git("--git-dir", str(root / DEMO_REPO), "rev-parse", DEMO_BRANCH)
    proto = ("-c", f"protocol.version={version}")

    rc, out, err = await agit(tmp_path, *proto, "ls-remote", url)
    assert rc == 0, err
    refs = dict(reversed(line.split("\t")) for line in out.splitlines())
    assert refs[f"refs/heads/{DEMO_BRANCH}"] == served and f"refs/tags/{DEMO_TAG}" in refs

    # a shallow clone, then a fetch that needs the server to negotiate the rest
    rc, _, err = await agit(tmp_path, *proto, "clone", "--depth", "1", url, "work")
    assert rc == 0, err
    work = tmp_path / "work"
    assert git("rev-parse", "HEAD", cwd=work) == served
    assert (work / "hello.py").read_text() == DEMO_COMMITS[-1].files["hello.py"]
    rc, _, err = await agit(work, *proto, "fetch", "--unshallow", "--tags", "origin")
    assert rc == 0, err
    assert git("rev-list", "--count", "HEAD", cwd=work) == str(len(DEMO_COMMITS))
    assert git("rev-parse", DEMO_TAG, cwd=work)


async def test_push_is_refused(git_site: tuple[TestClient, Path], tmp_path: Path) -> None:
    client, root = git_site
    url = str(client.make_url(f"/{DEMO_REPO}"))
    rc, _, err = await agit(tmp_path, "clone", url, "work")
    assert rc == 0, err
    work = tmp_path / "work"
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "--allow-empty", "-m", "x",
        cwd=work)  # fmt: skip
    before = git("--git-dir", str(root / DEMO_REPO), "rev-parse", DEMO_BRANCH)
    rc, _, _ = await agit(work, "push", "origin", "HEAD")
    assert rc != 0
    assert git("--git-dir", str(root / DEMO_REPO), "rev-parse", DEMO_BRANCH) == before


async def test_unknown_repository_is_404(git_site: tuple[TestClient, Path]) -> None:
    client, _ = git_site
    r = await client.get("/nothing.git/info/refs", params={"service": "git-upload-pack"})
    assert r.status == 404


async def test_gzipped_upload_pack_request(git_site: tuple[TestClient, Path]) -> None:
    """git gzips request bodies above 1 KiB; aiohttp decodes them before the bridge, which
    must then not tell the backend the body is still gzipped."""
    client, root = git_site
    want = git("--git-dir", str(root / DEMO_REPO), "rev-parse", DEMO_BRANCH)
    body = pkt(f"want {want}\n") + b"0000" + pkt("done\n")
    r = await client.post(
        f"/{DEMO_REPO}/git-upload-pack",
        data=gzip.compress(body),
        headers={
            "Content-Type": "application/x-git-upload-pack-request",
            "Content-Encoding": "gzip",
        },
    )
    assert r.status == 200, await r.text()
    assert r.headers["Content-Type"] == "application/x-git-upload-pack-result"
    data = await r.read()
    assert data.startswith(pkt("NAK\n")) and b"PACK" in data

"""A tiny pure-Python wheel and the PEP 503 pages that serve it, built in memory.

Hand-written with `zipfile` because the fake internet must work offline and without a
build backend: the demo runs on machines with no network, and the wheel has to be
byte-for-byte reproducible so its sha256 fragment is stable across runs.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import re
import zipfile
from dataclasses import dataclass

PROJECT = "stockade-demo-pkg"
VERSION = "1.0"
MODULE = "stockade_demo_pkg"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed zip timestamps: same bytes every build


@dataclass(frozen=True)
class Wheel:
    project: str
    version: str
    filename: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def normalize(name: str) -> str:
    """PEP 503 project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def build_wheel(project: str = PROJECT, version: str = VERSION, module: str = MODULE) -> Wheel:
    """A valid py3-none-any wheel with one module (METADATA, WHEEL, RECORD with hashes)."""
    dist = f"{module}-{version}"
    files: dict[str, bytes] = {
        f"{module}/__init__.py": (
            f'"""Demo package served by the Stockade fake internet."""\n\n'
            f'__version__ = "{version}"\n\n\n'
            f"def hello() -> str:\n"
            f'    return "hello from {project} {version}"\n'
        ).encode(),
        f"{dist}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
            f"Summary: Demo package served by the Stockade fake internet\n"
            f"Requires-Python: >=3.8\n"
        ).encode(),
        f"{dist}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: stockade.testnet\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{dist}.dist-info/top_level.txt": f"{module}\n".encode(),
    }
    record_name = f"{dist}.dist-info/RECORD"
    lines = [f"{name},{_record_hash(data)},{len(data)}" for name, data in files.items()]
    lines.append(f"{record_name},,")
    files[record_name] = ("\n".join(lines) + "\n").encode()

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
    return Wheel(project, version, f"{dist}-py3-none-any.whl", buf.getvalue())


def demo_wheels(projects: int = 1) -> list[Wheel]:
    """The demo project, then `projects - 1` more like it (`stockade-demo-pkg2`, ...)."""
    extra = [build_wheel(f"{PROJECT}{i}", module=f"{MODULE}{i}") for i in range(2, projects + 1)]
    return [build_wheel(), *extra]


def root_index(wheels: list[Wheel]) -> str:
    """`/simple/`: one anchor per project."""
    links = "\n".join(
        f'    <a href="/simple/{normalize(w.project)}/">{html.escape(w.project)}</a><br/>'
        for w in wheels
    )
    return (
        '<!DOCTYPE html>\n<html>\n  <head><meta name="pypi:repository-version" '
        'content="1.0"><title>Simple index</title></head>\n  <body>\n'
        f"{links}\n  </body>\n</html>\n"
    )


def project_page(project: str, wheels: list[Wheel]) -> str | None:
    """`/simple/<project>/`: files with `#sha256=` fragments; None when unknown."""
    mine = [w for w in wheels if normalize(w.project) == normalize(project)]
    if not mine:
        return None
    links = "\n".join(
        f'    <a href="/packages/{w.filename}#sha256={w.sha256}" '
        f'data-requires-python="&gt;=3.8">{w.filename}</a><br/>'
        for w in mine
    )
    return (
        '<!DOCTYPE html>\n<html>\n  <head><meta name="pypi:repository-version" '
        f'content="1.0"><title>Links for {html.escape(normalize(project))}</title></head>\n'
        f"  <body>\n    <h1>Links for {html.escape(normalize(project))}</h1>\n"
        f"{links}\n  </body>\n</html>\n"
    )

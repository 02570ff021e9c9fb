"""The demo wheel and the PEP 503 pages (pure): valid, reproducible, hashes match."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import sys
import zipfile
from pathlib import Path

from stockade.testing.testnet.wheel import (
    build_wheel,
    demo_wheels,
    normalize,
    project_page,
    root_index,
)


def test_wheel_is_reproducible() -> None:
    assert build_wheel().data == build_wheel().data


def test_wheel_metadata_and_record_hashes() -> None:
    w = build_wheel()
    assert w.filename == "stockade_demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(io.BytesIO(w.data)) as zf:
        names = zf.namelist()
        meta = zf.read("stockade_demo_pkg-1.0.dist-info/METADATA").decode()
        wheel = zf.read("stockade_demo_pkg-1.0.dist-info/WHEEL").decode()
        record = zf.read("stockade_demo_pkg-1.0.dist-info/RECORD").decode()
        rows = list(csv.reader(io.StringIO(record)))
        for path, digest, size in rows:
            if path.endswith("RECORD"):
                assert (digest, size) == ("", "")
                continue
            data = zf.read(path)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}"
            assert int(size) == len(data)
    assert "Name: stockade-demo-pkg" in meta and "Version: 1.0" in meta
    assert "Root-Is-Purelib: true" in wheel and "Tag: py3-none-any" in wheel
    assert {r[0] for r in rows} == set(names)


def test_wheel_module_imports(tmp_path: Path) -> None:
    w = build_wheel()
    path = tmp_path / w.filename
    path.write_bytes(w.data)
    sys.path.insert(0, str(path))
    try:
        import stockade_demo_pkg  # type: ignore[import-not-found]

        assert stockade_demo_pkg.hello() == "hello from stockade-demo-pkg 1.0"
    finally:
        sys.path.remove(str(path))
        sys.modules.pop("stockade_demo_pkg", None)


def test_pep503_pages() -> None:
    w = build_wheel()
    assert '<a href="/simple/stockade-demo-pkg/">' in root_index([w])
    page = project_page("Stockade_Demo.Pkg", [w])
    assert page is not None
    m = re.search(r'href="/packages/([^"#]+)#sha256=([0-9a-f]{64})"', page)
    assert m is not None
    assert m.group(1) == w.filename
    assert m.group(2) == hashlib.sha256(w.data).hexdigest()
    assert project_page("requests", [w]) is None


def test_normalize() -> None:
    assert normalize("Stockade_Demo.Pkg") == "stockade-demo-pkg"
    assert normalize("a--b__c") == "a-b-c"


def test_demo_wheels_are_distinct_projects_each_with_its_page() -> None:
    wheels = demo_wheels(30)
    assert wheels[0] == build_wheel()
    assert len({w.project for w in wheels}) == len({w.filename for w in wheels}) == 30
    assert wheels[1].filename == "stockade_demo_pkg2-1.0-py3-none-any.whl"
    index = root_index(wheels)
    for w in wheels:
        assert f'href="/simple/{normalize(w.project)}/"' in index
        page = project_page(w.project, wheels)
        assert page is not None and f"#sha256={w.sha256}" in page
        assert page.count("<a href=") == 1
    assert demo_wheels() == [build_wheel()]

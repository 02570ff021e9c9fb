"""Issue #14's structure numbers (stdlib ast): module sizes, function lengths, complexity,
import direction. `python scripts/structure_report.py [--limits]` (--limits: exit 1 on a breach);
tests/core/test_structure.py asserts on `report()`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"stockade": "stockade", "policy": "stockade.policy", "gateway": "stockade.gateway",
            "broker": "stockade.broker", "launcher": "stockade.launcher"}  # pyproject package-dir
COMPONENTS = ("stockade.gateway", "stockade.broker", "stockade.launcher")
LIBRARY = ("stockade.policy",)  # the rule model: over the ground floor, under the components
TOP = ("stockade.cli", "stockade.config", "stockade.configfile", "stockade.stack",
       "stockade.cli_doc", "stockade.config_doc", "stockade.readme_sync", "stockade.__main__")
TESTING = ("stockade.testing",)  # the rigs: the fake internet, the dev OpenBao
DATA_PATHS = ("stockade.gateway", "stockade.broker", "stockade.launcher", "stockade.net",
              "stockade.events.build", "stockade.policy.decide", "stockade.policy.hosts")
OFF_PATH = ("stockade.gateway.cli", "stockade.broker.cli", "stockade.launcher.cli",
            "stockade.launcher.nft:table_commands")  # CLIs; a literal nft table
MODULE_MAX, FUNC_MAX, CC_MAX = 500, 60, 15
_BRANCH = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.IfExp, ast.With,
           ast.AsyncWith, ast.Assert, ast.comprehension, ast.match_case)
_SCOPE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


class Func(NamedTuple):
    name: str  # module:Class.function
    where: str  # path:line
    lines: int
    cc: int


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith((p + ".", p + ":")) for p in prefixes)


def modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join([pkg, *(p for p in rel if p != "__init__")])] = path
    return out


MODULES = modules()


def layer(mod: str) -> str:
    if under(mod, TESTING):
        return "testing"
    if under(mod, TOP):
        return "top"
    return next((c for c in COMPONENTS + LIBRARY if under(mod, (c,))), "ground")


def complexity(fn: ast.AST) -> int:
    """radon's count: 1 + branches (+1 per loop/try else) + boolean operands beyond the
    first; nested functions and classes are measured on their own."""
    n, todo = 1, list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, _SCOPE):
            continue
        n += isinstance(node, _BRANCH)
        n += isinstance(node, ast.For | ast.AsyncFor | ast.While | ast.Try) and bool(node.orelse)
        n += len(node.values) - 1 if isinstance(node, ast.BoolOp) else 0
        todo.extend(ast.iter_child_nodes(node))
    return n


def functions(mod: str, path: Path, tree: ast.AST, prefix: str = "") -> list[Func]:
    out = []
    for node in ast.iter_child_nodes(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out += functions(mod, path, node, prefix)
            continue
        name = prefix + node.name
        if not isinstance(node, ast.ClassDef):
            out.append(Func(f"{mod}:{name}", f"{path.relative_to(ROOT)}:{node.lineno}",
                            node.end_lineno - node.lineno + 1, complexity(node)))
        out += functions(mod, path, node, name + ".")
    return out


def imports(mod: str, path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every stockade import, function-local and TYPE_CHECKING ones too."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names
                    if f"{base}.{a.name}" in MODULES]  # `from . import x`, x a module
    return [(n, m) for n, m in out if m.startswith("stockade.")]


def allowed(src: str, dst: str) -> bool:
    s, d = layer(src), layer(dst)
    if s in ("top", d):
        return True
    if s in ("ground", "testing", *LIBRARY):
        return d == "ground"
    return d in ("ground", "testing", *LIBRARY)  # a component


def report() -> tuple[dict[str, int], list[Func], list[str]]:
    sizes, funcs, bad = {}, [], set()
    for mod, path in MODULES.items():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        bad |= {f"{path.relative_to(ROOT)}:{n}: {mod} -> {d}"
                for n, d in imports(mod, path, tree) if not allowed(mod, d)}
        if not under(mod, TESTING):
            sizes[str(path.relative_to(ROOT))] = text.count("\n")
            funcs += functions(mod, path, tree)
    return sizes, funcs, sorted(bad)


def on_path(f: Func) -> bool:
    return under(f.name, DATA_PATHS) and not under(f.name, OFF_PATH)


def main(argv: list[str]) -> int:
    sizes, funcs, bad = report()
    big = sorted(((n, p) for p, n in sizes.items() if n > MODULE_MAX), reverse=True)
    over = sorted((f for f in funcs if f.lines > FUNC_MAX or f.cc > CC_MAX), key=lambda f: -f.cc)
    print(f"{len(sizes)} modules, {sum(sizes.values())} lines, {len(funcs)} functions")
    print(f"modules over {MODULE_MAX} lines: {len(big)}", *(f"  {n:5d} {p}" for n, p in big),
          sep="\n")
    print(f"over {FUNC_MAX} lines: {sum(f.lines > FUNC_MAX for f in funcs)}; complexity over "
          f"{CC_MAX}: {sum(f.cc > CC_MAX for f in funcs)}; (* data path)",
          *(f"  {f.lines:4d} lines cc {f.cc:3d} {'*' if on_path(f) else ' '} {f.where} "
            f"{f.name.split(':')[1]}" for f in over), sep="\n")
    print(f"upward/sideways imports: {len(bad)}", *(f"  {b}" for b in bad), sep="\n")
    breach = big or bad or any(map(on_path, over))
    return 1 if "--limits" in argv and breach else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

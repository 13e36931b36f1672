"""The import graph of fzero's modules has no circle, counting imports inside functions too (an
import moved into a function still ties the two modules together; it only hides the circle)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("fzero", "transforms", "models")  # the folders of fzero's modules


def package_dirs(root: Path, top=TOP) -> dict[str, Path]:
    """``{package name: its folder}``: pyproject's ``package-dir`` entries first (``fzero.transforms``
    in ``transforms/``), then each folder of ``top`` under its own name."""
    pyproject = root / "pyproject.toml"
    table = re.search(r"^package-dir\s*=\s*\{([^}]*)\}", pyproject.read_text(), re.M) if pyproject.exists() else None
    out = {name: root / folder for name, folder in re.findall(r'"([\w.]+)"\s*=\s*"([^"]+)"', table[1] if table else "")}
    out.update({name: root / name for name in top if name not in out})
    return {name: folder for name, folder in out.items() if folder.is_dir()}


def modules(dirs: dict[str, Path]) -> dict[str, str]:
    """``{real path: module name}`` of every ``.py`` file under ``dirs``, each file named once (by
    the first package it is found in: ``fzero.transforms.adam``, not ``transforms.adam``); a folder
    linked into a package (a symlink) is not walked twice."""
    out: dict[str, str] = {}
    for package, folder in dirs.items():
        for dirpath, dirnames, files in os.walk(folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not os.path.islink(os.path.join(dirpath, d))]
            for f in files:
                if f.endswith(".py"):
                    parts = [package, *Path(dirpath, f).relative_to(folder).with_suffix("").parts]
                    if parts[-1] == "__init__":
                        parts.pop()
                    out.setdefault(os.path.realpath(os.path.join(dirpath, f)), ".".join(parts))
    return out


def import_graph(root: Path, top=TOP) -> dict[str, set[str]]:
    """``{module: the modules of fzero it imports}``, anywhere in its text (module level,
    functions, ``if TYPE_CHECKING:``). ``from p import n`` imports ``p.n`` where that is a module,
    else ``p``; a module reached under a second name (a linked folder, a folder's own name) is
    the one module it is."""
    dirs = package_dirs(root, top)
    mods = modules(dirs)

    def resolve(name: str) -> str | None:
        owner = max((p for p in dirs if name == p or name.startswith(p + ".")), key=len, default=None)
        base = (dirs[owner].joinpath(*name[len(owner):].split(".")[1:]) if owner
                else root.joinpath(*name.split(".")))
        for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
            if path.exists():
                return mods.get(os.path.realpath(path))
        return None

    def imported(path: str, name: str):
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(Path(path).read_text(), path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    found = (resolve(".".join(parts[:k])) for k in range(len(parts), 0, -1))
                    yield next((m for m in found if m), None)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    here = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(here + ([node.module] if node.module else []))
                else:
                    source = node.module
                for alias in node.names:
                    yield resolve(f"{source}.{alias.name}") or resolve(source)

    return {name: {m for m in imported(path, name) if m and m != name} for path, name in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a set of modules that
    import one another in a circle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_fzero_has_no_import_circle():
    graph = import_graph(ROOT)
    assert "fzero.flat" in graph and "fzero.comm.arrival" in graph["fzero.comm.group"]  # the walk saw the package
    found = cycles(graph)
    assert found == [], "modules that import one another in a circle: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_circle_hidden_inside_a_function_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import g\n")
    (pkg / "a.py").write_text("def f():\n    from .sub.b import g  # hidden\n    return g\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n\ndef g():\n    return a\n")
    (pkg / "c.py").write_text("from pkg import a\nimport pkg.sub.b\n")
    graph = import_graph(tmp_path, ("pkg",))  # no pyproject.toml: the folder is the package
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.a", "pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]

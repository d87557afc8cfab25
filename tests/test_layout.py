"""The package layout: imports point down the layers, no module imports another inside a function, no circles.

    core < models < data < store < draft < {train, speculate, doctor, report} < pipeline < cli (and __main__)

A stage may use the layers below it and its own package; stages on one layer do not import each other.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "eyas"
RANK = {"core": 0, "models": 1, "data": 2, "store": 3, "draft": 4, "train": 5, "speculate": 5, "doctor": 5,
        "report": 5, "pipeline": 6, "cli": 7, "__main__": 8, "torchrun": 8}  # torchrun: an entry point, as __main__


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer(mod: str) -> tuple[int, str]:
    """(rank, package) of an eyas module; `python -m` entries sit on the top layer."""
    parts = mod.split(".")
    if parts[-1] == "__main__":
        return RANK["__main__"], "__main__"
    if len(parts) == 1:  # the eyas package itself: nothing but its version
        return 0, "eyas"
    return RANK[parts[1]], parts[1]


def eyas_targets(node: ast.AST) -> list[str]:
    """The eyas modules an import statement reads (a name that is a module counts as that module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "eyas"]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "eyas" and not node.level:
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
        return subs or [node.module]
    return []


def imports(path: Path) -> list[tuple[ast.AST, bool]]:
    """Every import statement of a file with whether it sits inside a function."""
    out = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, in_function))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(path.read_text(encoding="utf-8")), False)
    return out


def graph() -> dict[str, set[str]]:
    return {mod: {t for node, _ in imports(p) for t in eyas_targets(node)} for mod, p in MODULES.items()}


def test_every_module_is_in_a_known_layer():
    unknown = [m for m in MODULES if len(m.split(".")) > 1 and m.split(".")[1] not in RANK]
    assert not unknown, f"modules outside the layers {sorted(RANK)}: {unknown}; add the package to RANK"


def test_imports_point_down():
    upward = []
    for mod, targets in graph().items():
        rank, pkg = layer(mod)
        for t in targets:
            t_rank, t_pkg = layer(t)
            if t_pkg != pkg and t_rank >= rank and t != "eyas":
                upward.append(f"{mod} imports {t} ({t_pkg}, layer {t_rank} >= {rank})")
    assert not upward, "imports that do not point down:\n  " + "\n  ".join(upward)


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    circles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if t not in g:
                continue
            if state.get(t) == 1:
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


LAZY_EYAS = {"eyas.cli"}  # the one module that loads eyas modules on demand: `eyas --help` imports no stage


def test_no_import_inside_a_function_but_heavy_optional_ones_with_a_reason():
    """eyas modules are imported at the top (the CLI's table of stages aside, with its reason); a third-party
    import inside a function (a heavy or optional dependency, kept off the start-up path) carries its reason in a
    comment on its line or the line above."""
    bad = []
    for mod, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node, in_function in imports(path):
            if not in_function:
                continue
            where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
            if eyas_targets(node):
                if mod not in LAZY_EYAS:
                    bad.append(f"{where}: eyas import inside a function: {lines[node.lineno - 1].strip()}")
                continue
            top = (node.names[0].name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            if top in sys.stdlib_module_names and top not in ("fcntl", "ctypes", "msvcrt", "resource"):
                bad.append(f"{where}: standard-library import inside a function (import it at the top)")
            elif "#" not in lines[node.lineno - 1] and not lines[node.lineno - 2].strip().startswith("#"):
                bad.append(f"{where}: import inside a function without a reason comment")
    assert not bad, "\n".join(bad)


def string_imports(path: Path) -> list[str]:
    """Calls that import an eyas module named by a string (importlib.import_module, __import__, a lazy loader's
    find_spec): a link no reader, tool or the checks above can follow."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        arg = node.args[0]
        if isinstance(arg, ast.JoinedStr) and arg.values:  # f"eyas.{x}"
            arg = arg.values[0]
        if name in ("import_module", "__import__", "find_spec") and isinstance(arg, ast.Constant) \
                and str(arg.value).split(".")[0] == "eyas":
            out.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {name}({arg.value!r}...)")
    return out


def test_no_module_is_imported_by_a_string():
    """A stage is linked to its command by an import statement (eyas.pipeline.registry), never by its name in a
    string for importlib: such a link is invisible to readers, tools and this file's checks."""
    bad = [hit for path in MODULES.values() for hit in string_imports(path)]
    assert not bad, "modules imported by a string:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("bad, why", [
    ("from eyas.pipeline.stages import run_stage\n", "upward"),
    ("def f():\n    from eyas.core.log import console\n", "inside"),
    ("import importlib\nimportlib.import_module('eyas.store.extract')\n", "string"),
])
def test_the_checks_catch_what_they_guard(tmp_path, monkeypatch, bad, why):
    """The checks above fail on an upward import and on an import inside a function."""
    fake = tmp_path / "eyas" / "core" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(bad)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {"eyas.core.fake": fake, "eyas.pipeline.stages": fake})
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "eyas")
    check = {"upward": test_imports_point_down, "string": test_no_module_is_imported_by_a_string,
             "inside": test_no_import_inside_a_function_but_heavy_optional_ones_with_a_reason}[why]
    with pytest.raises(AssertionError):
        check()


DOCS = SRC.parents[1] / "docs"


def test_architecture_page_lists_every_module():
    """docs/architecture.md shows the tree as it is: every module and package folder under src/eyas/ is named."""
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for path in MODULES.values():
        rel = path.relative_to(SRC).as_posix()
        name = f"`{rel.removesuffix('__init__.py')}`" if path.name == "__init__.py" else f"`{rel}`"
        if path.parent != SRC or path.name != "__init__.py":
            if name not in page and f"**{name}**" not in page:
                missing.append(name)
    assert not missing, f"docs/architecture.md does not name {missing}: add them to its tree table"


def test_docs_name_modules_that_exist():
    """Every `eyas.<package>.<module>` a doc or the README names is a module of this tree (the layout moved files
    once; a stale name in a doc sends a reader to nothing)."""
    import re

    stale = []
    for doc in [*DOCS.glob("*.md"), SRC.parents[1] / "README.md"]:
        for m in re.finditer(r"\beyas((?:\.[a-z_][a-z0-9_]*)+)", doc.read_text(encoding="utf-8")):
            parts = ["eyas", *m.group(1).strip(".").split(".")]
            known = [".".join(parts[:n]) for n in range(2, len(parts) + 1) if ".".join(parts[:n]) in MODULES]
            if not known and parts[1] not in ("cli",):
                stale.append(f"{doc.name}: {m.group(0)}")
    assert not stale, "docs name modules that do not exist:\n  " + "\n  ".join(sorted(set(stale)))


def test_every_folder_is_a_package():
    """A folder of modules without __init__.py imports from a checkout (a namespace package) but is left out of
    an installed wheel (setuptools finds packages by their __init__.py)."""
    bare = sorted(str(d.relative_to(SRC)) for d in SRC.rglob("*") if d.is_dir() and any(d.glob("*.py"))
                  and not (d / "__init__.py").is_file())
    assert not bare, f"folders under src/eyas without __init__.py: {bare}"

"""The import rules of docs/architecture.md, checked on the source (no imports run)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "titanlite"


def imports_of(path: Path) -> set[str]:
    """Every titanlite module a file imports, at any depth, TYPE_CHECKING blocks excluded."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titanlite"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("titanlite"))
    return found


def modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py")) if folder else sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("parallel", ("titanlite.models", "titanlite.data", "titanlite.checkpoint", "titanlite.build", "titanlite.train")),
        ("checkpoint", ("titanlite.models", "titanlite.parallel.fsdp", "titanlite.build", "titanlite.train")),
        ("models", ("titanlite.checkpoint", "titanlite.data", "titanlite.build", "titanlite.train")),
        ("", ("titanlite.train",)),
    ],
)
def test_packages_import_only_what_the_architecture_allows(folder, forbidden):
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in modules(folder)
        if path.name != "train.py"
        for name in imports_of(path)
        if name.startswith(forbidden)
    ]
    assert not offenders, offenders


def test_config_engine_and_launcher_stay_leaves():
    assert imports_of(PACKAGE / "config_engine.py") <= {"titanlite.errors", "titanlite.errors.TitanliteError",
                                                          "titanlite.errors.USER_ERROR_EXIT_CODE"}
    # The launcher runs no training code: error codes, the host's core count for threads, and
    # the core blocks of --cpu-bind (a leaf the command line binds with before importing torch).
    launcher = imports_of(PACKAGE / "launch.py")
    assert {n.split(".")[1] for n in launcher} == {"errors", "parallel", "cpu_binding"}
    assert imports_of(PACKAGE / "cpu_binding.py") == set()
    assert {n for n in launcher if ".parallel." in n} == {"titanlite.parallel.distributed", "titanlite.parallel.distributed.usable_cores"}


def test_no_module_over_400_lines_and_no_class_over_200():
    long_modules = [p.name for p in modules("") if len(p.read_text().splitlines()) > 400]
    long_classes = [
        f"{p.relative_to(PACKAGE)}:{node.name}"
        for p in modules("")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200
    ]
    assert not long_modules and not long_classes, (long_modules, long_classes)

"""The layout and import rules of docs/architecture.md, checked on the source (no imports run)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "titanlite"
MAX_TOP_LEVEL_MODULES = 10

# Which top-level parts of titanlite each part may import (itself always). A part is a
# top-level module or package; a new one must be added here, with its place in the layers.
ALLOWED = {
    "errors": set(),
    "logging": set(),
    "model_spec": set(),
    "config": {"errors"},
    "parallel": {"config", "errors", "logging"},
    "compat": {"errors", "parallel"},
    "observe": {"config", "errors", "logging", "parallel"},
    "runtime": {"config", "errors", "logging", "parallel"},
    "data": {"config", "errors", "logging", "observe"},
    "models": {"config", "errors", "model_spec", "parallel"},
    "checkpoint": {"config", "data", "errors", "logging", "observe", "parallel"},
    "step": {"config", "data", "errors", "logging", "observe", "parallel"},
    "build": {"config", "data", "errors", "logging", "model_spec", "models", "parallel"},
    "trainer": {
        "build",
        "checkpoint",
        "config",
        "data",
        "errors",
        "logging",
        "model_spec",
        "observe",
        "parallel",
        "runtime",
        "step",
    },
    "train": {"config", "errors", "runtime", "trainer"},
    "generate": {"build", "checkpoint", "config", "errors", "logging", "models", "parallel", "runtime", "step"},
    "plan": {"build", "config", "errors", "logging", "parallel"},
    "launch": {"errors", "parallel", "runtime"},
    "__init__": set(),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """Every titanlite module a file imports, at any depth (function bodies too), resolved to
    a module where `from package import module` names one; TYPE_CHECKING blocks excluded."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titanlite"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("titanlite"))
    return found


def part(module: str) -> str:
    """`titanlite.step.loss` -> "step"; `titanlite` -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_top_level_holds_at_most_ten_modules_and_only_known_parts():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    parts = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    }
    assert parts <= set(ALLOWED), f"give {sorted(parts - set(ALLOWED))} a place in ALLOWED (and docs/architecture.md)"


def test_each_part_imports_only_the_parts_below_it():
    offenders = [
        f"{module} imports {target}"
        for module, path in MODULES.items()
        for target in imports_of(path)
        if part(target) != part(module) and part(target) not in ALLOWED[part(module)]
    ]
    assert not offenders, offenders


def test_no_import_cycle_between_modules():
    graph = {module: {t for t in imports_of(path) if t in MODULES and t != module} for module, path in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, cycles


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MODELS = "titanlite.models"
FAMILIES = sorted(f"{MODELS}.{p.name}" for p in (PACKAGE / "models").iterdir() if (p / "__init__.py").is_file())


def models_unit(module: str) -> str:
    """A module of titanlite.models as one unit of its package graph: the family package it is
    in, "registry" (models/__init__.py, which names every family), or "shared" (the modules
    directly in models/: the decoder, attention, MoE, ... every family builds on)."""
    if module == MODELS:
        return "registry"
    family = ".".join(module.split(".")[:3])
    return family if family in FAMILIES else "shared"


def models_graph() -> dict[str, set[str]]:
    """Which units of titanlite.models import which (imports inside functions too)."""
    graph = {unit: set() for unit in ("registry", "shared", *FAMILIES)}
    for module, path in MODULES.items():
        if module == MODELS or module.startswith(MODELS + "."):
            unit = models_unit(module)
            targets = {models_unit(t) for t in imports_of(path) if t == MODELS or t.startswith(MODELS + ".")}
            graph[unit] |= targets - {unit}
    return graph


def test_the_model_families_are_found():
    assert {f"{MODELS}.{name}" for name in ("llama", "qwen3", "gpt2")} <= set(FAMILIES)


def test_no_family_imports_another_family_or_the_registry():
    """A family builds on the shared modules only (docs/architecture.md), whatever families exist."""
    offenders = [
        f"{family} imports {target}"
        for family, targets in models_graph().items()
        if family in FAMILIES
        for target in targets
        if target != "shared"
    ]
    assert not offenders, offenders


def test_models_package_graph_has_no_cycle():
    """The registry over the families over the shared modules: no shared module imports a family
    (as moe.py once imported Llama's FeedForward), so no cycle between models/ and models/<family>/."""
    graph = models_graph()
    assert not graph["shared"] & set(FAMILIES), graph["shared"]
    assert not _cycles(graph), _cycles(graph)


@pytest.mark.parametrize(
    "module, allowed",
    [
        # The checkpoint package saves whatever it is handed: no model code, no FSDP.
        ("titanlite.checkpoint", lambda t: not t.startswith(("titanlite.models", "titanlite.parallel.fsdp"))),
        # The launcher runs no training code: error codes, the host's core count for threads,
        # the stop signals it forwards, the core blocks of --cpu-bind, the workers' stuck records.
        (
            "titanlite.launch",
            lambda t: (
                t
                in {
                    "titanlite.errors",
                    "titanlite.parallel.distributed",
                    "titanlite.runtime.cpu_binding",
                    "titanlite.runtime.preemption",
                    "titanlite.runtime.stuck",
                }
            ),
        ),
        # Binds cores before torch starts a thread: imports nothing of ours.
        ("titanlite.runtime.cpu_binding", lambda t: False),
        # The generic config engine names no section and knows nothing but the error type.
        ("titanlite.config.engine", lambda t: t == "titanlite.errors"),
        ("titanlite.config.output", lambda t: t == "titanlite.config.engine"),
    ],
)
def test_finer_rules(module, allowed):
    paths = [p for name, p in MODULES.items() if name == module or name.startswith(module + ".")]
    assert paths
    offenders = [
        f"{p.relative_to(PACKAGE)} imports {t}"
        for p in paths
        for t in imports_of(p)
        if not allowed(t) and not t.startswith(module)
    ]
    assert not offenders, offenders


def test_the_command_line_checks_the_config_before_torch_is_imported():
    """`python -m titanlite.train` and `titanlite.config` import no torch at module level
    (config/dtypes.py, which parses dtype names into torch dtypes, is not imported by them)."""
    heavy = []
    for name in (
        "titanlite.train",
        *[m for m in MODULES if m.startswith("titanlite.config") and m != "titanlite.config.dtypes"],
        "titanlite.runtime.cpu_binding",
        "titanlite.errors",
    ):
        tree = ast.parse(MODULES[name].read_text())
        for node in tree.body:
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            heavy += [
                f"{name} imports {n}" for n in names if n.split(".")[0] == "torch" or n == "titanlite.config.dtypes"
            ]
    assert not heavy, heavy


def test_no_module_over_450_lines_and_no_class_over_240():
    """Lines as ruff formats them (one argument a line once a call passes 120 characters): the tree
    grew about 10% when the formatter came in, and these limits with it (from 400 and 200)."""
    long_modules = [p.name for p in MODULES.values() if len(p.read_text().splitlines()) > 450]
    long_classes = [
        f"{p.relative_to(PACKAGE)}:{node.name}"
        for p in MODULES.values()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 240
    ]
    assert not long_modules and not long_classes, (long_modules, long_classes)

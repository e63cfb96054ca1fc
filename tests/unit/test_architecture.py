"""The layout and import rules of docs/architecture.md, checked on the source (no imports run)."""

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "titanlite"
MAX_TOP_LEVEL_MODULES = 10

# Which top-level parts of titanlite each part may import (itself always). A part is a
# top-level module or package; a new one must be added here, with its place in the layers.
ALLOWED = {
    "errors": set(),
    "logging": set(),
    "model_spec": {"errors"},
    "config": {"errors"},
    "parallel": {"config", "errors", "logging", "model_spec"},
    "compat": {"errors", "parallel"},
    "observe": {"config", "errors", "logging", "parallel"},
    "runtime": {"config", "errors", "logging", "parallel", "step"},
    "data": {"config", "errors", "logging", "observe"},
    "models": {"config", "errors", "model_spec", "parallel"},
    "checkpoint": {"config", "data", "errors", "logging", "model_spec", "observe", "parallel"},
    "step": {"config", "data", "errors", "logging", "observe", "parallel"},
    "build": {"config", "data", "errors", "logging", "model_spec", "models", "parallel"},
    "startup": {"build", "checkpoint", "config", "data", "errors", "logging", "observe", "parallel", "runtime", "step"},
    "trainer": {
        "build",
        "startup",
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
    """Every titanlite module a file imports, at any depth (function bodies and
    `if TYPE_CHECKING:` blocks too: an import for type hints alone still ties the two modules
    together), resolved to a module where `from package import module` names one."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
        ("titanlite.config.parse", lambda t: t in {"titanlite.errors", "titanlite.config.engine"}),
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


MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_CODE_LINES, MAX_TRAINER_LINES = 400, 200, 40, 120


def code_lines(source: str) -> set[int]:
    """The lines that hold code tokens, docstrings left out (as `count_code_lines.py` in the
    shared tools counts them): a function's size without its comments and docstring."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = {
        line
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in skipped
        for line in range(token.start[0], token.end[0] + 1)
    }
    return lines - docstrings


def size_offenders(path: Path) -> list[str]:
    """What in one file is over the limits: the module (raw lines, as ruff formats them), a
    class (raw lines), a function (code lines), `Trainer` (raw lines)."""
    source = path.read_text()
    name = path.relative_to(PACKAGE)
    found = [f"{name}: {len(source.splitlines())} lines"] if len(source.splitlines()) > MAX_MODULE_LINES else []
    code = code_lines(source)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        raw = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            limit = MAX_TRAINER_LINES if (str(name), node.name) == ("trainer.py", "Trainer") else MAX_CLASS_LINES
            if raw > limit:
                found.append(f"{name}:{node.lineno} class {node.name}: {raw} lines")
        else:
            n = len([line for line in range(node.lineno, node.end_lineno + 1) if line in code])
            if n > MAX_FUNCTION_CODE_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {n} code lines")
    return found


def test_no_module_over_400_lines_no_class_over_200_no_function_over_40_code_lines():
    """Lines as ruff formats them (the run's format check keeps the tree formatted); a function
    counts its code lines (no docstring, comment or blank line), and the trainer's `Trainer`,
    a composition root, stays at 120."""
    offenders = [line for path in MODULES.values() for line in size_offenders(path)]
    assert not offenders, offenders


def test_the_size_limits_catch_each_kind_of_offender(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(40))
    big_function = tmp_path / "f.py"
    big_function.write_text(f'def f():\n    """Why."""\n{body}\n')
    assert [line.split(": ")[1] for line in _sizes_of(big_function)] == ["41 code lines"]
    commented = tmp_path / "g.py"
    commented.write_text("def g():\n" + "    # a comment\n" * 50 + "    return 1\n")
    assert _sizes_of(commented) == []
    big_class = tmp_path / "c.py"
    big_class.write_text("class C:\n" + "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(67)))
    assert any("class C: 201 lines" in line for line in _sizes_of(big_class))
    long_module = tmp_path / "m.py"
    long_module.write_text("x = 1\n" * 401)
    assert _sizes_of(long_module) == ["m.py: 401 lines"]


def _sizes_of(path: Path) -> list[str]:
    global PACKAGE
    saved, PACKAGE = PACKAGE, path.parent
    try:
        return size_offenders(path)
    finally:
        PACKAGE = saved


def annotation_offenders(path: Path) -> list[str]:
    """A model's args or its HF adapter typed `Any` (or not at all): `args`/`base` parameters
    of titanlite/models and model_spec.py, `adapter` parameters anywhere (the checkpoint
    package's HF readers and writers take one), and the fields of `ModelSpec`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.arg in ("args", "base", "adapter") and (
                    arg.annotation is None or "Any" in ast.unparse(arg.annotation)
                ):
                    found.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
        if isinstance(node, ast.ClassDef) and node.name == "ModelSpec":
            found += [
                f"{path.name}: ModelSpec.{field.target.id}"
                for field in node.body
                if isinstance(field, ast.AnnAssign) and "Any" in ast.unparse(field.annotation)
            ]
    return found


def test_no_model_args_or_hf_adapter_typed_any():
    paths = [
        p
        for name, p in MODULES.items()
        if name.startswith((MODELS, "titanlite.checkpoint.hf_")) or name == "titanlite.model_spec"
    ]
    offenders = [line for path in paths for line in annotation_offenders(path)]
    assert not offenders, offenders


def test_the_annotation_check_finds_an_any(tmp_path):
    source = tmp_path / "spec.py"
    source.write_text(
        "from typing import Any\n"
        "class ModelSpec:\n    hf_adapter: Any = None\n"
        "def f(args: Any): ...\ndef g(args): ...\ndef h(args: int, base: 'X | None' = None): ...\n"
    )
    assert sorted(annotation_offenders(source)) == [
        "spec.py: ModelSpec.hf_adapter",
        "spec.py:4 f(args)",
        "spec.py:5 g(args)",
    ]


def test_type_checking_imports_count_for_cycles(tmp_path):
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from titanlite.errors import X\n")
    assert imports_of(source) == {"titanlite.errors"}

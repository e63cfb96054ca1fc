"""The docs against the code they describe: every module of titanlite/ named in
docs/architecture.md, every repository path the README and docs/ mention there, and the
parallelize order stated in one place (docs/parallelism.md), the others pointing to it; the
README's introduction against the model registry and its layout against the tree; the float8
tolerances the docs give against the test's."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.token_data import make_prepared
from titanlite.config import JobConfig, torchtitan
from titanlite.parallel.mesh import Meshes
from titanlite.parallel.parallelize import parallelize
from titanlite.step.builder import StepBuilder

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("titanlite", "tests", "docs", "scripts", "examples", "bench", "train_configs", "assets", ".ci")
# A path in backticks or a link, from a top-level folder of the repository (bare file names
# are often a run's outputs, `config.toml`, or a user's, `tokenizer.model`).
PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*[\w/])(?![\w(])" % "|".join(re.escape(t) for t in TOP))


def mentioned_paths(text: str) -> set[str]:
    found = set()
    for quoted in re.findall(r"`([^`\n]+)`|\]\(([^)\s]+)\)", text):
        for chunk in quoted:
            found.update(m.group(1) for m in PATH.finditer(chunk))
    return {p.split("#")[0].rstrip("/.") for p in found if not re.search(r"[<>*{}]|\.\.\.", p)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc):
    text = doc.read_text()
    base = REPO if doc.name == "README.md" else doc.parent
    missing = sorted(p for p in mentioned_paths(text) if not (REPO / p).exists() and not (base / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_every_module_is_named_in_the_architecture_page():
    page = (REPO / "docs" / "architecture.md").read_text()
    modules = [p for p in (REPO / "titanlite").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    unnamed = sorted(
        str(p.relative_to(REPO / "titanlite"))
        for p in modules
        if f"`{p.name}`" not in page
        and f"{p.relative_to(REPO / 'titanlite')}`" not in page
        and f"/{p.name}`" not in page
    )
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"


# What each step of the parallelize order calls, in `parallel/parallelize.parallelize`.
ORDER_CALLS = {
    "float8": "convert_to_float8(",
    "EP": "apply_ep(",
    "TP": "parallelize_module(",
    "LoRA": "lora_adapters(",
    "CP": "enable_context_parallel(",
    "AC": "apply_ac(",
    "compile": "apply_compile(",
    "FSDP": "_data_parallel(",
}


def test_the_parallelize_order_is_stated_once():
    """The order lives in docs/parallelism.md; every other page points there instead of
    restating it (restated copies drifted: context parallelism was missing from three of
    them), and it is the order in which `parallelize` calls each step (expert parallelism
    was once missing from it)."""
    chains = {doc.name: len(re.findall(r"\bTP\s*->", doc.read_text())) for doc in DOCS}
    assert chains.pop("parallelism.md") == 1 and not any(chains.values()), chains
    stated = re.search(r"((?:\w+ -> )+\w+)", (REPO / "docs" / "parallelism.md").read_text()).group(1)
    source = inspect.getsource(parallelize)
    assert all(source.count(call) == 1 for call in ORDER_CALLS.values()), ORDER_CALLS
    applied = sorted(ORDER_CALLS, key=lambda step: source.index(ORDER_CALLS[step]))
    assert stated.split(" -> ") == applied, f"docs/parallelism.md says {stated}; parallelize applies {applied}"


def test_every_parallelize_argument_is_documented():
    """Each keyword of `parallelize` in its docstring; `pipelined`, which only the trainer
    passes, in docs/parallelism.md too."""
    keywords = [name for name, p in inspect.signature(parallelize).parameters.items() if p.kind == p.KEYWORD_ONLY]
    undocumented = [name for name in keywords if f"    {name}: " not in parallelize.__doc__]
    assert not undocumented, f"parallelize's docstring does not say what {undocumented} do"
    assert "pipelined=" in (REPO / "docs" / "parallelism.md").read_text()


def test_every_example_runs_with_no_arguments():
    """`torchrun ... examples/X.py`, as docs/library.md shows them, needs no flag."""
    needing = [p.name for p in (REPO / "examples").glob("*.py") if "required=True" in p.read_text()]
    assert not needing, needing


def python_block_after(doc: str, text: str) -> str:
    """The first ```python block of docs/`doc` after `text`."""
    page = (REPO / "docs" / doc).read_text()
    return re.search(r"```python\n(.*?)```", page[page.index(text) :], re.S).group(1)


def test_the_loader_snippet_runs_on_a_mesh_without_data_parallelism(tmp_path):
    """docs/library.md's loader lines, as written (the folder aside), on one process, whose
    `build_mesh()` has no data-parallel view: `meshes.dp` is None, as on a tp-only mesh."""
    import titanlite

    make_prepared(tmp_path / "tokens", 2 * 8 * 2049)
    snippet = python_block_after("library.md", "titanlite.prepared_loader(folder")
    assert '"/data/tokens"' in snippet
    namespace = {"titanlite": titanlite, "meshes": titanlite.build_mesh()}
    assert namespace["meshes"].dp is None
    exec(snippet.replace('"/data/tokens"', repr(str(tmp_path / "tokens"))), namespace)
    try:
        assert namespace["inputs"].shape == namespace["labels"].shape == (8, 2048)
        assert torch.equal(namespace["inputs"][:, 1:], namespace["labels"][:, :-1])
    finally:
        namespace["loader"].close()


def modules_by_name() -> dict[str, list[str]]:
    """Every titanlite module's dotted name, by its last part (`fsdp` -> titanlite.parallel.fsdp)."""
    found: dict[str, list[str]] = {}
    for path in (REPO / "titanlite").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts[-1] != "__main__":
            found.setdefault(parts[-1], []).append(".".join(parts))
    return found


def has_attributes(owner: object, names: list[str]) -> bool:
    """owner.a.b...; a dataclass's field counts though the class has no attribute for it."""
    for name in names:
        fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
        if not hasattr(owner, name) and name not in fields:
            return False
        owner = getattr(owner, name, None)
    return True


# A doc's `section.key` is a config key, or torchtitan's name that titanlite reads or refuses.
SECTIONS = {name: {f.name for f in dataclasses.fields(section)} for name, section in vars(JobConfig()).items()}
TORCHTITAN_KEYS = {*torchtitan.ALIASES, *torchtitan.OFF_ONLY, *torchtitan.NO_EFFECT}
# A doc's `module.name` (or `Class.name`) is checked against titanlite's module (or class) of
# that name, except where the first word is another project's package or a wrapper's argument.
NOT_OURS = {"config", "hfai", "megatron", "model", "optimizer", "torch"}
FILE_SUFFIXES = {"py", "md", "toml", "json", "jsonl", "sh"}
MODEL_ATTRIBUTES = {"model.layers", "model.summon_full_params"}
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(|`)")


def dotted_name_exists(
    name: str, call: bool, modules: dict[str, list[str]], classes: dict[str, list[type]]
) -> bool | None:
    """True or False for a name this test can check; None for another kind (a file, torch's,
    a call on an object named like a section: `optimizer.step()`, a model's `model.layers`)."""
    head, *rest = name.split(".")
    if rest[-1] in FILE_SUFFIXES or name in MODEL_ATTRIBUTES or (call and head in SECTIONS):
        return None
    if head in SECTIONS and len(rest) == 1:
        return rest[0] in SECTIONS[head] or (head, rest[0]) in TORCHTITAN_KEYS
    if head == "titanlite":
        for i in range(len(rest), -1, -1):  # the longest prefix that imports, then attributes
            try:
                module = importlib.import_module(".".join([head, *rest[:i]]))
            except ImportError:
                continue
            return has_attributes(module, rest[i:])
    if head in NOT_OURS:
        return None
    if head in modules:
        return any(has_attributes(importlib.import_module(module), rest) for module in modules[head])
    if head in classes:
        return any(has_attributes(cls, rest) for cls in classes[head])
    return None


def titanlite_classes(modules: dict[str, list[str]]) -> dict[str, list[type]]:
    found: dict[str, list[type]] = {}
    for module in (importlib.import_module(m) for names in modules.values() for m in names):
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                found.setdefault(name, []).append(value)
    return found


def test_every_module_function_and_config_key_a_doc_names_exists():
    """`fsdp.expert_shard_dim`, `StepBuilder.reported`, `training.seq_len`: the names the docs
    give in backticks are in the code (`expert_parallel.experts_placement` outlived its function)."""
    modules = modules_by_name()
    classes = titanlite_classes(modules)
    missing = sorted(
        f"{doc.name}: {name}"
        for doc in DOCS
        for name, after in set(DOTTED.findall(doc.read_text()))
        if dotted_name_exists(name, after == "(", modules, classes) is False
    )
    assert not missing, f"named in the docs but not in the code: {missing}"


# Files a docstring or comment may name that live in other projects (torch, transformers,
# Megatron-core) or that a run writes.
ELSEWHERE = {
    "config.toml",
    "convert_llama_weights_to_hf.py",
    "_functional_collectives.py",
    "distributed_c10d.py",
    "schedules.py",
    "stage.py",
    "torch_fully_sharded_data_parallel.py",
}
# Paths inside another project's tree (torchtitan's own files, which the torchtitan tables follow).
ELSEWHERE_ROOTS = ("torchtitan/",)
FILE_NAME = re.compile(r"(?<![\w.])((?:[\w.-]+/)*[\w-]+\.(?:py|sh|md|toml))\b")


def test_every_file_a_docstring_names_exists():
    """A module's docstrings and comments name files of the repository by a path or a bare
    name (`config.py` was split into config/sections.py and load.py, DESIGN.md is not here)."""
    files = {str(p.relative_to(REPO)) for p in REPO.rglob("*") if not {".git", ".venv"} & set(p.parts)}
    missing = sorted(
        f"{path.relative_to(REPO)}: {name}"
        for path in (REPO / "titanlite").rglob("*.py")
        for name in set(FILE_NAME.findall(path.read_text()))
        if name.split("/")[-1] not in ELSEWHERE
        and not name.startswith(ELSEWHERE_ROOTS)
        and not any(f == name or f.endswith("/" + name) for f in files)
    )
    assert not missing, missing


def test_the_architecture_page_names_each_view_of_meshes_and_each_part_of_the_step_builder():
    page = (REPO / "docs" / "architecture.md").read_text()
    views = [f.name for f in dataclasses.fields(Meshes)] + ["context_parallel"]
    assert not [v for v in views if f".{v}" not in page], f"`Meshes` views the page does not name: {views}"
    public = [name for name in vars(StepBuilder) if not name.startswith("_")]
    unnamed = [name for name in public if f"`{name}`" not in page and f".{name}`" not in page]
    assert not unnamed, f"docs/architecture.md does not name StepBuilder's {unnamed}"


def family_folders() -> list[Path]:
    return sorted(p.parent for p in (REPO / "titanlite" / "models").glob("*/__init__.py"))


def readme_layout() -> str:
    readme = (REPO / "README.md").read_text()
    return re.search(r"## Layout\n+```\n(.*?)```", readme, re.S).group(1)


def test_the_readme_layout_lists_every_model_family_and_shared_layer():
    models = " ".join(line for line in readme_layout().splitlines() if line.startswith("titanlite/models/"))
    modules = [p.name for p in (REPO / "titanlite" / "models").glob("*.py") if p.name != "__init__.py"]
    unlisted = [name for name in [f"{p.name}/" for p in family_folders()] + modules if name not in models]
    assert not unlisted, f"README.md's layout does not list titanlite/models/ {unlisted}"


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_a_family_without_a_hugging_face_adapter_is_said_to_have_none(doc):
    text = (REPO / doc).read_text()
    for family in family_folders():
        says_none = re.search(rf"`?{family.name}/`?[^;|\n]*\bno HF adapter", text) is not None
        assert says_none == (not (family / "hf_adapter.py").exists()), f"{doc} on {family.name}'s HF adapter"


def test_generate_page_lists_the_layouts_its_tests_generate_with():
    """docs/generate.md's table of layouts: each one the run tests generate with (the
    parametrized layouts of test_every_layout_prints_what_one_process_prints) is there."""
    tree = ast.parse((REPO / "tests" / "runs" / "test_generate.py").read_text())
    (test,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_every_layout")]
    (parametrize,) = [d for d in test.decorator_list if isinstance(d, ast.Call) and d.func.attr == "parametrize"]
    tested = [case.elts[0].value for case in parametrize.args[1].elts]
    table = re.search(r"\| layout \| generates \|.*?\n\n", (REPO / "docs" / "generate.md").read_text(), re.S).group(0)
    assert tested and not [name for name in tested if f"`{name}`" not in table], (tested, table)


def test_the_readme_layout_lists_every_package_and_top_level_module():
    layout = readme_layout()
    names = [f"titanlite/{p.name}/" for p in (REPO / "titanlite").iterdir() if (p / "__init__.py").exists()]
    names += [p.name for p in (REPO / "titanlite").glob("*.py")]
    assert not [name for name in names if name not in layout], names


def readme_introduction() -> str:
    readme = (REPO / "README.md").read_text()
    return readme[: readme.index("\n## ")]


def test_the_readme_introduction_names_every_registered_model_family():
    """`deepseek_v3` trained for a while before the introduction named it: each `model.name` of
    the registry, its letters and digits (deepseek_v3: DeepSeek-V3, gpt2: GPT-2), is in the text."""
    from titanlite.models import model_names

    def letters(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.lower())

    unnamed = [name for name in model_names() if letters(name) not in letters(readme_introduction())]
    assert not unnamed, f"README.md's introduction does not name the model families {unnamed}"


def layout_lines() -> dict[str, list[str]]:
    """The README layout's lines by the folder of their first path (`titanlite/models/`, `docs/`, ...)."""
    lines: dict[str, list[str]] = {}
    for line in readme_layout().splitlines():
        first = line.split()[0] if line.strip() else ""
        if "/" in first:
            lines.setdefault(first[: first.rindex("/") + 1], []).append(line)
    return lines


def test_every_path_and_file_the_readme_layout_names_exists():
    """A path from the repository's root, or a bare file name on a line, under the folder of that
    line's first path (`decoder.py` on a `titanlite/models/` line)."""
    missing = []
    for folder, lines in layout_lines().items():
        for line in lines:
            missing += [p for p in PATH.findall(line) if not (REPO / p.rstrip("/")).exists()]
            bare = re.findall(r"(?<![\w/])(\w+\.(?:py|md|toml))\b", line)
            missing += [f"{folder}{n}" for n in bare if not any((REPO / folder).rglob(n))]
    assert not missing, f"README.md's layout names what does not exist: {missing}"


def test_the_readme_layout_names_every_runtime_module_and_every_doc():
    lines = layout_lines()
    runtime = " ".join(lines["titanlite/runtime/"])
    docs = " ".join(lines["docs/"])
    modules = [p.name for p in (REPO / "titanlite" / "runtime").glob("*.py") if p.name != "__init__.py"]
    unnamed = [f"titanlite/runtime/{name}" for name in modules if name not in runtime]
    unnamed += [f"docs/{p.name}" for p in (REPO / "docs").glob("*.md") if p.name not in docs]
    assert not unnamed, f"README.md's layout does not name {unnamed}"


def test_the_float8_layout_tolerances_docs_give_are_the_tests():
    """docs/recipes.md and docs/float8.md give the float8 layouts' tolerances the equivalence
    test allows (recipes.md once said 1e-4 for all of them, and the grad norm is allowed 1e-3)."""
    from tests.runs.equivalence_checks import FLOAT8_FIRST_STEP_REL, FLOAT8_REL

    def short(x: float) -> str:
        return re.sub(r"e-0*", "e-", f"{x:.0e}")

    first, later = (
        [short(tolerances[k]) for k in ("loss", "grad_norm")] for tolerances in (FLOAT8_FIRST_STEP_REL, FLOAT8_REL)
    )
    recipes = " ".join((REPO / "docs" / "recipes.md").read_text().split())
    float8 = " ".join((REPO / "docs" / "float8.md").read_text().split())
    assert f"within {later[0]} on the loss and {later[1]} on the grad norm" in recipes, later
    assert f"({first[0]} and {first[1]} at the first step)" in recipes, first
    assert f"within {first[0]} on the loss and {first[1]} on the grad norm" in float8, first
    assert f"later steps within {later[0]} and {later[1]}" in float8, later

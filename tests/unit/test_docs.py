"""The docs against the code they describe: every module of titanlite/ named in
docs/architecture.md, every repository path the README and docs/ mention there, and the
parallelize order stated in one place (docs/parallelism.md), the others pointing to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers.token_data import make_prepared

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


def test_the_parallelize_order_is_stated_once():
    """The order (TP -> CP -> AC -> compile -> FSDP) lives in docs/parallelism.md; every other
    page points there instead of restating it (restated copies drifted: context parallelism
    was missing from three of them)."""
    chains = {doc.name: len(re.findall(r"\bTP\s*->", doc.read_text())) for doc in DOCS}
    assert chains.pop("parallelism.md") == 1 and not any(chains.values()), chains
    assert "TP -> CP -> AC -> compile -> FSDP" in (REPO / "docs" / "parallelism.md").read_text()


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

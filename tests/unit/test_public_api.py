"""`import titanlite`: the library's names (docs/library.md) load lazily, so importing the
package imports no torch, and every name in `__all__` resolves to what the docs describe."""

import subprocess
import sys

from tests.helpers.distributed import REPO


def test_importing_titanlite_imports_no_torch():
    code = "import sys, titanlite; assert 'torch' not in sys.modules, 'torch imported'; print(len(titanlite.__all__))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_exported_name_resolves_and_is_documented():
    import titanlite

    docs = (REPO / "docs" / "library.md").read_text()
    for name in titanlite.__all__:
        assert getattr(titanlite, name) is not None
        assert f"titanlite.{name}" in docs, f"docs/library.md does not show titanlite.{name}"
    assert set(titanlite.__all__) <= set(dir(titanlite))


def test_an_unknown_name_is_an_attribute_error():
    import titanlite

    try:
        titanlite.no_such_name
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")

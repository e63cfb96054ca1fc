"""titanlite/data/verify.py (`python -m titanlite.data.verify FOLDER`): a folder whose files match
its manifest's checksums is one summary line and exit 0; anything else is one line that starts
with the first bad file or the folder (never the placeholder word FOLDER), exit 2, no traceback."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.helpers.token_data import (  # noqa: F401 (fixtures)
    change_a_token_inside_the_vocabulary,
    drop_checksums,
    prepared,
    tok,
)
from titanlite.data.token_shards import TokenShards
from titanlite.data.verify import main


pytestmark = pytest.mark.usefixtures("logger_left_as_found")  # main() sets the logger up (tests/conftest.py)


def run(folder, capsys) -> tuple[int, list[str], list[str]]:
    code = main([str(folder)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_a_prepared_folder_verifies(prepared, capsys):
    folder = prepared[0]
    count = len(TokenShards(folder).entries)
    code, out, err = run(folder, capsys)
    assert (code, err, len(out)) == (0, [], 1)
    assert (
        f"{folder}: all {count} shards ({2 * count} files, " in out[0]
        and " match the CRC-32s in manifest.json (" in out[0]
    )


def damage_inside_the_vocabulary(folder):
    change_a_token_inside_the_vocabulary(folder / "shard-00002.bin", 40)
    return r"shard-00002\.bin is corrupted: CRC-32 [0-9a-f]{8}, the manifest records [0-9a-f]{8}"


def remove_a_shard(folder):
    (folder / "shard-00001.idx").unlink()
    return r"shard-00001\.idx is missing \(listed in .*manifest\.json\)"


def drop_the_checksums(folder):
    drop_checksums(folder)
    return (
        r"manifest\.json records no checksums for shard-00000 \(prepared before titanlite wrote them\), so "
        r"nothing can be verified"
    )


@pytest.mark.parametrize("damage", [damage_inside_the_vocabulary, remove_a_shard, drop_the_checksums])
def test_a_bad_folder_is_one_line_naming_the_file(prepared, tmp_path, capsys, damage):
    folder = tmp_path / "copy"
    shutil.copytree(prepared[0], folder)
    message = damage(folder)
    code, out, err = run(folder, capsys)
    assert (code, out, len(err)) == (2, [], 1)
    assert err[0].startswith(f"titanlite: error: {folder}/") and re.search(message, err[0]), err[0]


def test_what_is_not_a_prepared_dataset_is_one_line(prepared, capsys):
    text = prepared[0].parent / "text"  # the corpus the fixture prepared from
    assert run(text, capsys) == (
        2,
        [],
        [
            f"titanlite: error: {text} is not a prepared dataset (no manifest.json; "
            f"write one with python -m titanlite.data.prepare SOURCE {text} --tokenizer PATH)"
        ],
    )
    assert run(text / "docs.jsonl", capsys) == (
        2,
        [],
        [f"titanlite: error: {text / 'docs.jsonl'} is not a prepared dataset (not a folder)"],
    )
    code, out, err = main([]), *capsys.readouterr()
    assert (code, out, err) == (2, "", "titanlite: error: the following arguments are required: FOLDER\n")

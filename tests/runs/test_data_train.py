"""The prepared path through the real trainer: exact resume with shuffling and a blend of
two prepared datasets, and one line with exit code 2 for each bad data input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.helpers.distributed import read_tensorboard, run_mains, run_ranks, with_overrides
from tests.helpers.token_data import SHIPPED, folder_bytes, write_corpus
from tests.helpers.tokenizer_files import write_rank_file
from titanlite.data.prepare import prepare
from titanlite.data.sources import FilesSource
from titanlite.data.tokenizers import Tokenizer

BASE = [
    "--config",
    "debug_model",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--training.mixed_precision_param",
    "float32",
    "--training.dataset",
    "prepared",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.decay_ratio",
    "0",  # constant lr after warmup: "5, stop, resume to 10" == "10"
    "--metrics.log_freq",
    "1",
    "--metrics.peak_flops",
    "1e11",
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    "5",
    "--checkpoint.async_mode",
    "disabled",
]


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> tuple[Path, str]:
    """Two small prepared datasets (a few hundred windows of 65 tokens each) and their blend."""
    root = tmp_path_factory.mktemp("blend")
    tok = Tokenizer(str(SHIPPED))
    for name, seed, n in (("web", 1, 120), ("code", 2, 50)):
        write_corpus(root / f"{name}-text", n=n, seed=seed)
        prepare(FilesSource(str(root / f"{name}-text")), tok, root / name, workers=1, shard_chars=20_000)
    return root, f"{root / 'web'}:0.7,{root / 'code'}:0.3"


def train(dump: Path, dataset_path: str, steps: int) -> str:
    args = BASE + [
        "--training.dataset_path",
        dataset_path,
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        str(dump),
    ]
    result = run_ranks(2, ["-m", "titanlite.train"], args, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(900)
def test_exact_resume_with_shuffle_and_blend(tmp_path, blend):
    _, path = blend
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, path, 10)
    train(resumed, path, 5)
    log = train(resumed, path, 10)
    assert "resumed at step 5" in log
    want = dict(read_tensorboard(straight / "tb")["loss"])
    got: dict[int, float] = {}
    for run in sorted({p.parent for p in (resumed / "tb").rglob("events.out.tfevents.*")}):
        got.update(dict(read_tensorboard(run)["loss"]))
    assert sorted(got) == list(range(1, 11)) and got == want  # exact, every step


def run_cases(cases: dict[str, list[str]], dump: Path) -> dict[str, tuple[int, list[str]]]:
    """1-process runs of `titanlite.train.main`, in one interpreter: name -> (exit code, stderr lines)."""
    argvs = [
        with_overrides(BASE, argv, ["--training.steps", "1", "--job.dump_folder", str(dump / name)])
        for name, argv in cases.items()
    ]
    runs = run_mains("titanlite.train", argvs, 300)
    return {
        name: (run.returncode, [line for line in run.stderr.splitlines() if line.strip()])
        for name, run in zip(cases, runs)
    }


def damaged_copy(source: Path, folder: Path, damage: str) -> Path:
    folder.mkdir(parents=True)
    for name, data in folder_bytes(source).items():
        (folder / name).write_bytes(data)
    if damage == "missing":
        (folder / "shard-00001.bin").unlink()
    elif damage == "truncated":
        shard = folder / "shard-00000.bin"
        shard.write_bytes(shard.read_bytes()[:-2])
    else:
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    return folder


@pytest.mark.timeout(600)
def test_bad_data_inputs_are_one_line_and_exit_2(tmp_path, blend):
    root, _ = blend
    web = root / "web"
    random_text = tmp_path / "random.txt"
    random_text.write_bytes(bytes(range(256)) * 64)
    other_tokenizer = tmp_path / "tokenizer.model"
    write_rank_file(other_tokenizer, [b"th", b"he", b"the"])  # a tiktoken file: another vocabulary
    cases = {
        "missing_shard": ([str(damaged_copy(web, tmp_path / "m", "missing"))], "shard-00001.bin is missing"),
        "truncated_shard": ([str(damaged_copy(web, tmp_path / "t", "truncated"))], "shard-00000.bin is truncated"),
        "future_version": ([str(damaged_copy(web, tmp_path / "f", "future"))], "format version 2"),
        "weights_do_not_parse": ([f"{web}:0.5,{web}:lots"], "is not folder:weight"),
        "weights_sum_to_0": ([f"{web}:0,{web}:0.0"], "the blend weights sum to 0"),
        "not_prepared": ([str(root / "web-text")], "is not a prepared dataset"),
        "other_tokenizer": (
            [str(web), "--model.tokenizer_path", str(other_tokenizer)],
            "prepared with another tokenizer",
        ),
        "random_bytes_txt": (
            [str(random_text), "--training.dataset", "files", "--training.dataset_cache_dir", str(tmp_path / "c")],
            "random.txt is not",
        ),
    }
    if importlib.util.find_spec("tiktoken") is None:
        cases.pop("other_tokenizer")
    results = run_cases(
        {name: ["--training.dataset_path", argv[0], *argv[1:]] for name, (argv, _) in cases.items()}, tmp_path
    )
    for name, (_, expected) in cases.items():
        code, lines = results[name]
        assert code == 2 and len(lines) == 1, (name, lines)
        assert lines[0].startswith("titanlite: error: training.dataset_path: ") and expected in lines[0], (name, lines)

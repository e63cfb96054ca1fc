"""titanlite/checkpoint/export.py and the scripts over it (scripts/export_checkpoint.py,
scripts/convert_hf.py): a DCP folder to one torch.save file, Hugging Face safetensors out and
back exactly, loaded by transformers with equal logits; in-process, one process, no torchrun."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.scripts import script_main
from tests.helpers.stand_ins import TINY, tiny_model
from titanlite.checkpoint import commit, export, hf_io
from titanlite.errors import TitanliteError
from titanlite.models.llama import llama3_hf as hf_llama
from titanlite.models.llama.model import Llama


def test_dcp_folder_to_full_file_loads_into_plain_model(tmp_path):
    """A model-and-optimizer DCP checkpoint -> one torch.save file of just the model."""
    model = tiny_model(seed=1)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, TINY.vocab_size, (1, 8))).sum().backward()
    optim.step()
    dcp.save(
        {"model": model.state_dict(), "optimizer": optim.state_dict()}, checkpoint_id=tmp_path / "step-1", no_dist=True
    )
    n = export.dcp_to_full_file(tmp_path / "step-1", tmp_path / "model.pt")
    plain = Llama(TINY)
    plain.init_weights(seed=99)  # builds the RoPE table (a non-persistent buffer); weights are overwritten next
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert n == len(model.state_dict())
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    assert torch.equal(plain(tokens), model(tokens))
    half = export.read_dcp_model(tmp_path / "step-1", torch.bfloat16)
    assert half["output.weight"].dtype == torch.bfloat16


def test_hf_export_then_import_round_trips_exactly(tmp_path):
    pytest.importorskip("safetensors")
    state = tiny_model(seed=2).state_dict()
    hf_io.save_hf_weights(state, tmp_path / "hf", hf_llama, TINY)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["intermediate_size"] == TINY.ffn_hidden_dim
    back = hf_io.read_hf_model(tmp_path / "hf", hf_llama, TINY, Llama)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    other = dataclasses.replace(TINY, dim=128)
    with pytest.raises(TitanliteError, match="config.json: describes another model: hidden_size 64"):
        hf_io.read_hf_model(tmp_path / "hf", hf_llama, other, Llama)


def test_hf_export_loads_in_transformers_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(seed=3)
    hf_io.save_hf_weights(model.state_dict(), tmp_path / "hf", hf_llama, TINY)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32, attn_implementation="eager"
    )
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def _script(name: str):
    return script_main(name)


def test_export_and_convert_scripts_round_trip(tmp_path, capsys):
    pytest.importorskip("safetensors")
    model = tiny_model(seed=4)
    optim = torch.optim.AdamW(model.parameters())
    step = tmp_path / "checkpoint" / "step-2"
    dcp.save({"model": model.state_dict(), "optimizer": optim.state_dict()}, checkpoint_id=step, no_dist=True)
    fingerprint = {"name": "llama3", "flavor": "debugmodel", "args": repr(TINY)}
    commit.write_commit(
        step,
        commit.CommitRecord(
            step=2, fingerprint=fingerprint, contents=["model", "optimizer"], model_args=dataclasses.asdict(TINY)
        ),
    )
    state = model.state_dict()

    assert _script("export_checkpoint.py")([str(tmp_path / "checkpoint"), str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(exported[k], state[k]) for k in state)

    convert = _script("convert_hf.py")
    assert convert(["to-hf", str(step), str(tmp_path / "hf")]) == 0
    assert all(torch.equal(v, state[k]) for k, v in hf_io.read_hf_model(tmp_path / "hf", hf_llama, TINY, Llama).items())
    assert convert(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = export.read_dcp_model(tmp_path / "back")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert commit.read_commit(tmp_path / "back").model_weights_only

    capsys.readouterr()
    assert _script("export_checkpoint.py")([str(tmp_path / "nope"), str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nope does not exist" in err


def _debug_export(path, vocab_size: int = 96):
    """The debug model's weights as `export_checkpoint.py` writes them (a .pt state dict)."""
    from titanlite.models import get_model_spec

    spec = get_model_spec("llama3", "debugmodel")
    torch.save(spec.model_class(spec.args_for("debugmodel", vocab_size)).state_dict(), path)
    return path


def test_to_hf_refuses_weights_of_another_flavor_in_one_line(tmp_path, capsys):
    """The docs' `to-hf model.pt --flavor 8B --vocab-size 128256` on the debug model's export
    wrote an 8B config.json around 256-dim tensors (and exit 0): every tensor must have the
    shape of the config.json written beside it, a missing or foreign one is named too."""
    pytest.importorskip("safetensors")
    source, out = _debug_export(tmp_path / "model.pt"), tmp_path / "hf"
    convert = _script("convert_hf.py")
    flavor_8b = ["--flavor", "8B", "--vocab-size", "128256"]
    what = "--model llama3 --flavor 8B --vocab-size 128256"
    capsys.readouterr()
    assert convert(["to-hf", str(source), str(out), *flavor_8b]) == 2
    assert capsys.readouterr().err == (
        f"titanlite: error: {source}: tensor tok_embeddings.weight has shape [96, 256], but {what} has [128256, 4096]\n"
    )
    assert not out.exists() and not (tmp_path / "hf.partial").exists()

    state = torch.load(source, weights_only=True)
    debug = ["--flavor", "debugmodel", "--vocab-size", "96"]
    torch.save({k: v for k, v in state.items() if k != "norm.weight"}, tmp_path / "less.pt")
    assert convert(["to-hf", str(tmp_path / "less.pt"), str(out), *debug]) == 2
    assert capsys.readouterr().err.endswith(
        "less.pt: tensor norm.weight of --model llama3 --flavor debugmodel --vocab-size 96 is missing\n"
    )
    torch.save({**state, "extra.weight": torch.zeros(3)}, tmp_path / "more.pt")
    assert convert(["to-hf", str(tmp_path / "more.pt"), str(out), *debug]) == 2
    assert capsys.readouterr().err.endswith(
        "more.pt: tensor extra.weight is not part of --model llama3 --flavor debugmodel --vocab-size 96\n"
    )
    assert not out.exists()
    assert convert(["to-hf", str(source), str(out), *debug]) == 0
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 256


@pytest.fixture
def progress_every_item(monkeypatch):
    """Progress lines at every item (a tiny model is read in well under the 5 s between lines)."""
    from titanlite.checkpoint import load_progress

    monkeypatch.setattr(load_progress, "PROGRESS_EVERY_S", 0.0)


def test_export_and_convert_scripts_say_how_far_they_got(tmp_path, capsys, progress_every_item):
    """export_checkpoint.py, to-hf and from-hf on a large model are minutes of reading and
    writing: each says how much there is, how far it got, and when it is done."""
    pytest.importorskip("safetensors")
    step = tmp_path / "checkpoint" / "step-2"
    dcp.save({"model": tiny_model(seed=5).state_dict()}, checkpoint_id=step, no_dist=True)
    fingerprint = {"name": "llama3", "flavor": "debugmodel", "args": repr(TINY)}
    record = commit.CommitRecord(
        step=2, fingerprint=fingerprint, contents=["model"], model_args=dataclasses.asdict(TINY)
    )
    commit.write_commit(step, record)
    runs = {
        "export": (_script("export_checkpoint.py"), [str(step), str(tmp_path / "model.pt")]),
        "to-hf": (_script("convert_hf.py"), ["to-hf", str(step), str(tmp_path / "hf")]),
        "from-hf": (_script("convert_hf.py"), ["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]),
        "from-hf .pt": (_script("convert_hf.py"), ["from-hf", str(tmp_path / "hf"), str(tmp_path / "back.pt")]),
    }
    logs = {}
    for name, (main, argv) in runs.items():
        capsys.readouterr()
        assert main(argv) == 0, name
        logs[name] = capsys.readouterr().out

    def lines(log: str, what: str) -> list[str]:
        return [line.split(" ", 1)[1] for line in log.splitlines() if line.split(" ", 1)[-1].startswith(what)]

    for name, log in logs.items():
        reads = lines(log, "checkpoint load: ")
        assert len(reads) >= 3 and " holds " in reads[0] and "%" in reads[1] and ": done, " in reads[-1], (name, log)
    for name in ("to-hf", "from-hf"):
        writes = lines(logs[name], "checkpoint write: ")
        assert " from this rank" in writes[0] and "100% (" in writes[-2] and ": done, " in writes[-1], (name, writes)
    for name, out in (("export", "model.pt"), ("from-hf .pt", "back.pt")):
        assert lines(logs[name], "export: writing ")[0].endswith(f" to {tmp_path / out}"), logs[name]

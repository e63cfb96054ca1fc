"""Checkpoint policy, train state, HF mapping and exports: in-process, one process, no torchrun."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.stand_ins import CountingLoader
from titanlite.checkpoint import commit, export, integrity, policy
from titanlite.checkpoint.train_state import TrainState, rng_key
from titanlite.config import Checkpoint
from titanlite.errors import TitanliteError
from titanlite.models.llama import hf_adapter as hf_llama
from titanlite.models.llama.model import Llama, LlamaArgs, apply_rope, rope_cos_sin

TINY = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=32, rope_theta=500000.0)


def tiny_model(seed: int = 0, args: LlamaArgs = TINY) -> Llama:
    model = Llama(args)
    model.init_weights(seed=seed)
    return model


def make_step(root, step: int, *, committed: bool = True, weights_only: bool = False) -> None:
    folder = commit.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    if committed:
        commit.write_commit(folder, commit.CommitRecord(step=step, fingerprint={"name": "x"}, contents=["model"], model_weights_only=weights_only))


# ------------------------------------------------------- policy and commits


def test_should_save_every_interval_and_at_the_end():
    assert [s for s in range(1, 11) if policy.should_save(s, 4, last=s == 10)] == [4, 8, 10]


def test_resume_picks_newest_committed_and_reports_incomplete(tmp_path):
    for step in (5, 10):
        make_step(tmp_path, step)
    make_step(tmp_path, 15, committed=False)
    choice = policy.choose_resume(tmp_path, -1)
    assert choice.step == 10 and choice.path == tmp_path / "step-10"
    assert len(choice.notes) == 1 and "step-15" in choice.notes[0] and "ignoring" in choice.notes[0]
    assert policy.choose_resume(tmp_path, 5).step == 5


def test_resume_skips_weights_only_exports_but_not_the_seed(tmp_path):
    make_step(tmp_path, 0, weights_only=True)
    assert policy.choose_resume(tmp_path, -1).step == 0
    make_step(tmp_path, 4)
    make_step(tmp_path, 8, weights_only=True)
    choice = policy.choose_resume(tmp_path, -1)
    assert choice.step == 4 and any("weights only" in n for n in choice.notes)
    with pytest.raises(TitanliteError, match="weights only"):
        policy.choose_resume(tmp_path, 8)


def test_empty_folder_starts_fresh(tmp_path):
    assert policy.choose_resume(tmp_path / "nothing", -1).step is None


@pytest.mark.parametrize(
    "setup, step, message",
    [
        ("none", 3, "does not exist"),
        ("some", 7, "step-7 does not exist; complete steps: 5"),
        ("some", 9, "step-9 is incomplete"),
    ],
)
def test_asked_for_load_step_never_starts_fresh(tmp_path, setup, step, message):
    root = tmp_path / "ckpt"
    if setup == "some":
        make_step(root, 5)
        make_step(root, 9, committed=False)
    with pytest.raises(TitanliteError, match=message) as info:
        policy.choose_resume(root, step)
    assert "\n" not in str(info.value) and "checkpoint.load_step" in str(info.value)


def test_retention_keeps_latest_k_and_cleans_older_debris():
    assert policy.retention_victims([2, 4, 6, 8], 2, 8) == [2, 4]
    assert policy.retention_victims([2, 4], 0, 4) == []
    assert policy.retention_victims([2, 4, 6], 1, 4) == [2]  # a newer folder (another timeline) is not counted
    assert policy.stale_incomplete([3, 9], 6) == [3]


def test_save_kind_last_step_is_blocking_and_weights_only_when_asked():
    cfg = Checkpoint(async_mode="async", model_weights_only=True, export_dtype="bfloat16")
    assert policy.save_kind(cfg, last=False) == policy.SaveKind(weights_only=False, export_dtype=None, blocking=False)
    assert policy.save_kind(cfg, last=True) == policy.SaveKind(weights_only=True, export_dtype="bfloat16", blocking=True)
    full = Checkpoint(async_mode="disabled")
    assert policy.save_kind(full, last=False).blocking and not policy.save_kind(full, last=True).weights_only
    seed = commit.CommitRecord(step=0, fingerprint={}, contents=["model"], model_weights_only=True)
    assert not policy.is_export(seed) and policy.is_export(dataclasses.replace(seed, step=5))


def test_commit_is_atomic_rename_and_round_trips(tmp_path):
    record = commit.CommitRecord(step=3, fingerprint={"name": "llama3"}, contents=["model"], mesh={"tp": 2})
    commit.write_commit(tmp_path, record)
    assert sorted(os.listdir(tmp_path)) == [commit.COMMIT_FILE]
    again = commit.read_commit(tmp_path)
    assert again.step == 3 and again.mesh == {"tp": 2} and again.saved_at
    commit.remove_commit(tmp_path)
    assert commit.read_commit(tmp_path) is None


def test_initial_load_accepts_dcp_folder_or_root(tmp_path):
    make_step(tmp_path / "root", 3)
    make_step(tmp_path / "root", 6)
    assert policy.resolve_initial_load(tmp_path / "root")[0] == tmp_path / "root" / "step-6"
    assert policy.resolve_initial_load(tmp_path / "root" / "step-3")[0] == tmp_path / "root" / "step-3"
    with pytest.raises(TitanliteError, match="does not exist"):
        policy.resolve_initial_load(tmp_path / "missing")
    with pytest.raises(TitanliteError, match="not a DCP checkpoint"):
        policy.resolve_initial_load(tmp_path)


# ------------------------------------------------------------- train state


def test_train_state_restores_step_tokens_and_rng():
    state = TrainState(step=7, tokens_seen=1234)
    torch.manual_seed(3)
    saved = state.state_dict()
    expected = torch.rand(4)
    fresh = TrainState()
    fresh.load_state_dict(saved)
    assert (fresh.step, fresh.tokens_seen) == (7, 1234)
    assert torch.equal(torch.rand(4), expected)
    assert set(saved) == {"step", "tokens_seen", rng_key(0)}


# ----------------------------------------------------------------- HF map


def test_rope_permutation_is_an_inverse_pair():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(hf_llama.half_to_interleaved(hf_llama.interleaved_to_half(w, 4), 4), w)


def test_rope_permutation_maps_interleaved_rope_to_rotate_half_rope():
    """Our interleaved RoPE on wq equals HF's rotate-half RoPE on the permuted wq, up to
    the same per-head reordering of features (which attention scores do not see)."""
    args = TINY
    x = torch.randn(1, 5, args.dim)
    wq = torch.randn(args.n_heads * args.head_dim, args.dim)
    cos_sin = rope_cos_sin(args, "cpu")
    ours = apply_rope((x @ wq.T).view(1, 5, args.n_heads, args.head_dim), cos_sin)
    q_hf = (x @ hf_llama.interleaved_to_half(wq, args.n_heads).T).view(1, 5, args.n_heads, args.head_dim)
    cos, sin = cos_sin[:5].real, cos_sin[:5].imag  # the table holds cos + i*sin
    cos, sin = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    half = args.head_dim // 2
    rotate_half = torch.cat([-q_hf[..., half:], q_hf[..., :half]], -1)
    hf = q_hf * cos + rotate_half * sin
    ours_as_half = torch.cat([ours[..., 0::2], ours[..., 1::2]], -1)
    torch.testing.assert_close(hf, ours_as_half, rtol=1e-5, atol=1e-5)


def test_hf_names_and_round_trip_are_exact():
    state = tiny_model().state_dict()
    hf = hf_llama.to_hf(state, TINY)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.post_attention_layernorm.weight"} <= set(hf)
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (TINY.kv_heads * TINY.head_dim, TINY.dim)
    back = hf_llama.from_hf(hf, TINY)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_hf_config_check_names_each_mismatch():
    config = hf_llama.hf_config(TINY)
    assert hf_llama.check_hf_config(config, TINY) == []
    assert hf_llama.check_hf_config({**config, "num_key_value_heads": None}, TINY) == ["num_key_value_heads 4 (this model: 2)"]
    assert hf_llama.check_hf_config(config, dataclasses.replace(TINY, n_layers=3, vocab_size=100)) == [
        "num_hidden_layers 2 (this model: 3)", "vocab_size 96 (this model: 100)"]


def test_hf_config_round_trips_to_args():
    for args in (TINY, dataclasses.replace(TINY, rope_scaling=(8.0, 1.0, 4.0, 8192), ffn_dim_multiplier=1.3)):
        config = hf_llama.hf_config(args)
        again = hf_llama.args_from_hf_config(config)
        assert hf_llama.hf_config(again) == config


# ----------------------------------------------------------------- exports


def test_dcp_folder_to_full_file_loads_into_plain_model(tmp_path):
    """A model-and-optimizer DCP checkpoint -> one torch.save file of just the model."""
    model = tiny_model(seed=1)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, TINY.vocab_size, (1, 8))).sum().backward()
    optim.step()
    dcp.save({"model": model.state_dict(), "optimizer": optim.state_dict()}, checkpoint_id=tmp_path / "step-1", no_dist=True)
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
    export.save_hf(state, TINY, hf_llama, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["intermediate_size"] == TINY.ffn_hidden_dim
    back = export.load_hf(tmp_path / "hf", hf_llama, TINY)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    other = dataclasses.replace(TINY, dim=128)
    with pytest.raises(TitanliteError, match="config.json: describes another model: hidden_size 64"):
        export.load_hf(tmp_path / "hf", hf_llama, other)


def test_hf_export_loads_in_transformers_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(seed=3)
    export.save_hf(model.state_dict(), TINY, hf_llama, tmp_path / "hf")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32, attn_implementation="eager")
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- scripts


def _script(name: str):
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / name), run_name="script")["main"]


def test_export_and_convert_scripts_round_trip(tmp_path, capsys):
    pytest.importorskip("safetensors")
    model = tiny_model(seed=4)
    optim = torch.optim.AdamW(model.parameters())
    step = tmp_path / "checkpoint" / "step-2"
    dcp.save({"model": model.state_dict(), "optimizer": optim.state_dict()}, checkpoint_id=step, no_dist=True)
    fingerprint = {"name": "llama3", "flavor": "debugmodel", "args": repr(TINY)}
    commit.write_commit(step, commit.CommitRecord(step=2, fingerprint=fingerprint, contents=["model", "optimizer"], model_args=dataclasses.asdict(TINY)))
    state = model.state_dict()

    assert _script("export_checkpoint.py")([str(tmp_path / "checkpoint"), str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(exported[k], state[k]) for k in state)

    convert = _script("convert_hf.py")
    assert convert(["to-hf", str(step), str(tmp_path / "hf")]) == 0
    assert all(torch.equal(v, state[k]) for k, v in export.load_hf(tmp_path / "hf", hf_llama, TINY).items())
    assert convert(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = export.read_dcp_model(tmp_path / "back")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert commit.read_commit(tmp_path / "back").model_weights_only

    capsys.readouterr()
    assert _script("export_checkpoint.py")([str(tmp_path / "nope"), str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nope does not exist" in err


# ------------------------------------------------------------ manager, 1 process


def _manager(folder, model, tokenizer=None, **cfg):
    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.models.llama import llama3_spec

    checkpoint_cfg = Checkpoint(**{"enable_checkpoint": True, "interval": 1, "async_mode": "disabled", "keep_latest_k": 1, **cfg})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state, data = TrainState(), CountingLoader()
    manager = CheckpointManager(checkpoint_cfg, str(folder), llama3_spec, "tiny", TINY, model=model, optimizer=optimizer,
                                lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), dataloader=data,
                                train_state=state, tokenizer=tokenizer)
    return manager, optimizer, state, data


def test_manager_without_process_group_resumes_and_tolerates_missing_rng(tmp_path, monkeypatch):
    """One plain process (no torch.distributed): save, retention, resume; a rank the
    checkpoint has no RNG state for (it was saved at a smaller world) keeps its own."""
    import warnings

    from titanlite.checkpoint import train_state as train_state_module

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model = tiny_model(seed=5)
    manager, optimizer, state, data = _manager(tmp_path, model)
    for step in (1, 2):
        model(torch.randint(0, TINY.vocab_size, (1, 8))).sum().backward()
        optimizer.step()
        state.step, data.position = step, step * 8
        manager.save(step, last=step == 2)
    manager.close()
    assert commit.scan(tmp_path / "checkpoint").complete == (2,)  # keep_latest_k 1

    fresh = tiny_model(seed=6)
    monkeypatch.setattr(train_state_module, "_rank", lambda: 1)
    again, _, state2, data2 = _manager(tmp_path, fresh)  # as if rank 1 of a larger world than the checkpoint's
    again.load()
    assert (state2.step, data2.position) == (2, 16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def _train_and_save(manager, model, optimizer, state, data, steps) -> None:
    for step in steps:
        model(torch.randint(0, TINY.vocab_size, (1, 8))).sum().backward()
        optimizer.step()
        state.step, data.position = step, step * 8
        manager.save(step, last=False)


def test_retention_retires_in_the_step_and_deletes_in_the_background(tmp_path, monkeypatch):
    """An old step leaves the checkpoint set inside `save` (un-committed, moved to .trash);
    the delete itself runs on the housekeeping thread; a crash's leftovers go next run."""
    import shutil
    import threading
    import warnings

    from titanlite.checkpoint import housekeeping

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    deleted_by, real_rmtree = [], shutil.rmtree

    def rmtree(path, *args, **kwargs):
        deleted_by.append((Path(path).name.split(".")[0], threading.current_thread().name))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(housekeeping.shutil, "rmtree", rmtree)
    root = tmp_path / "checkpoint"
    (root / commit.TRASH_DIR / "step-0.123").mkdir(parents=True)  # left by a run that crashed mid-delete
    model = tiny_model(seed=7)
    manager, optimizer, state, data = _manager(tmp_path, model, keep_latest_k=2)
    _train_and_save(manager, model, optimizer, state, data, (1, 2, 3, 4))
    assert commit.scan(root).complete == (3, 4)  # retired at once: discovery no longer sees 1 and 2
    manager.close()
    assert sorted(deleted_by) == [("step-0", "titanlite-housekeeping"), ("step-1", "titanlite-housekeeping"),
                                  ("step-2", "titanlite-housekeeping")]
    assert list((root / commit.TRASH_DIR).iterdir()) == []


def test_checksums_are_recorded_and_a_shard_corrupted_inside_its_data_is_named(tmp_path):
    """Flipped bytes in the middle of a shard deserialize fine; the checksum catches them."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model = tiny_model(seed=8)
    manager, optimizer, state, data = _manager(tmp_path, model)
    _train_and_save(manager, model, optimizer, state, data, (1,))
    manager.close()
    folder = commit.step_dir(tmp_path / "checkpoint", 1)
    record = commit.read_commit(folder)
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    assert sorted(record.checksums) == shards and not integrity.sidecars(folder)  # merged, then cleaned up
    assert all(integrity.file_crc32(folder / name) == crc for name, crc in record.checksums.items())

    shard = folder / shards[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    again, *_ = _manager(tmp_path, tiny_model(seed=9))
    with pytest.raises(TitanliteError, match=f"^{shard}: shard file is corrupted \\(CRC-32 [0-9a-f]{{8}}, recorded at save {record.checksums[shard.name]}\\)$"):
        again.load()
    again.close()
    with pytest.raises(TitanliteError, match="shard file is corrupted"):
        export.read_dcp_model(folder)  # the export and conversion scripts read through here


def test_resume_with_another_tokenizer_is_refused(tmp_path):
    import types
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    tokenizer_file = tmp_path / "tok.model"
    tokenizer_file.write_bytes(b"tokenizer A" * 100)
    model = tiny_model(seed=10)
    manager, optimizer, state, data = _manager(tmp_path, model, tokenizer=types.SimpleNamespace(path=str(tokenizer_file), vocab_size=96))
    _train_and_save(manager, model, optimizer, state, data, (1,))
    manager.close()
    assert commit.read_commit(commit.step_dir(tmp_path / "checkpoint", 1)).tokenizer == {
        "path": str(tokenizer_file), "vocab_size": 96, "crc32": integrity.file_crc32(tokenizer_file)}

    other = tmp_path / "other.model"
    other.write_bytes(b"tokenizer B" * 100)
    for tokenizer, difference in [((other, 96), "CRC-32"), ((tokenizer_file, 100), "its vocabulary has 100 tokens, the checkpoint's 96")]:
        again, *_ = _manager(tmp_path, tiny_model(seed=11), tokenizer=types.SimpleNamespace(path=str(tokenizer[0]), vocab_size=tokenizer[1]))
        with pytest.raises(TitanliteError, match="^model.tokenizer_path: ") as info:
            again.load()
        again.close()
        assert f"is not the tokenizer {tmp_path / 'checkpoint' / 'step-1'} was trained with ({tokenizer_file}): {difference}" in str(info.value)


def test_async_staging_reuses_its_buffers_and_copies_what_the_tensors_held_at_staging():
    """The second and later saves go through `GilFreeStateDictStager`'s own copy (uint8 views
    of the two storages): same buffers as the first save, exactly the live values of the
    moment, including a view into a shared storage, and untouched by later updates."""
    from titanlite.checkpoint.async_save import BackgroundStager, GilFreeStateDictStager

    staging = BackgroundStager(shared_memory=False)
    try:
        assert isinstance(staging.usable()._state_dict_stager, GilFreeStateDictStager)
        base = torch.arange(12, dtype=torch.float32)
        live = {"w": torch.randn(4, 3), "view": base[4:10].view(2, 3), "whole": base, "step": torch.tensor(3.0)}
        first = staging.usable().stage(live).result()
        for tensor in live.values():
            tensor.add_(1.0)
        expected = {k: v.clone() for k, v in live.items()}
        second = staging.usable().stage(live).result()
        for tensor in live.values():
            tensor.mul_(-2.0)
        for key in live:
            assert second[key].data_ptr() == first[key].data_ptr(), key
            assert torch.equal(second[key], expected[key]), key
        assert second["view"].untyped_storage().data_ptr() == second["whole"].untyped_storage().data_ptr()
    finally:
        staging.close()

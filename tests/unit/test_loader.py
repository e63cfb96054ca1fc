"""titanlite/data/loader.py over prepared shards: batches are windows with shifted labels, dp ranks
partition each global microbatch, state resumes exactly at any dp degree and through DCP, prefetch
gives the same batches and forwards errors, another data's state warns."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.token_data import SEQ, assert_same, make_prepared, shards, stream_of, take  # noqa: F401 (fixtures)
from titanlite.data.loader import TokenWindowLoader
from titanlite.data.token_shards import TokenShards
from titanlite.data.windows import DatasetWindows, WindowStream
from titanlite.errors import TitanliteError


def loader(stream: WindowStream, batch: int, rank: int = 0, dp: int = 1, prefetch: bool = True) -> TokenWindowLoader:
    return TokenWindowLoader(stream, batch, rank, dp, prefetch=prefetch)


def test_batches_are_windows_with_shifted_labels(shards):
    unshuffled = stream_of(shards, seed=None)
    x, y = next(loader(unshuffled, 3))
    assert x.shape == y.shape == (3, SEQ) and x.dtype == torch.long
    for b in range(3):
        assert x[b].tolist() == list(range(b * 16, b * 16 + SEQ)) and y[b].tolist() == list(
            range(b * 16 + 1, b * 16 + 16)
        )


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_partition_the_global_microbatch(shards, dp):
    B = 2
    reference = loader(stream_of(shards), B * dp)
    ranks = [loader(stream_of(shards), B, r, dp) for r in range(dp)]
    for _ in range(30):  # past one epoch of 200 windows
        want_x, want_y = next(reference)
        got = [next(r) for r in ranks]
        assert torch.equal(torch.cat([x for x, _ in got]), want_x) and torch.equal(
            torch.cat([y for _, y in got]), want_y
        )
    assert all(r.state_dict() == reference.state_dict() for r in ranks)
    same_dp_rank = loader(stream_of(shards), B, 1, dp)  # a tp peer of rank 1
    assert_same(take(same_dp_rank, 3), [ranks[1].batch_at(p) for p in range(0, 3 * B * dp, B * dp)])


@pytest.mark.parametrize("save_dp,load_dp", [(2, 4), (2, 1), (4, 2), (1, 4)])
def test_resume_at_another_dp_degree_starts_at_the_next_global_window(tmp_path, save_dp, load_dp):
    a, b = make_prepared(tmp_path / "a", 16 * 90), make_prepared(tmp_path / "b", 16 * 50, first=1000)

    def blend():
        return WindowStream(
            [DatasetWindows(a, 16, 0, 90, 3, 0), DatasetWindows(b, 16, 0, 50, 3, 1)], [0.7, 0.3], "blend"
        )

    global_batch = 8
    reference = loader(blend(), global_batch)
    saved = [loader(blend(), global_batch // save_dp, r, save_dp) for r in range(save_dp)]
    for _ in range(17):
        next(reference)
        for r in saved:
            next(r)
    state = saved[-1].state_dict()
    assert state == saved[0].state_dict() == reference.state_dict() == {"windows": 136, "data": "blend", "seq_len": SEQ}
    resumed = [loader(blend(), global_batch // load_dp, r, load_dp) for r in range(load_dp)]
    for r in resumed:
        r.load_state_dict(state)
    for _ in range(20):
        want_x, _ = next(reference)
        assert torch.equal(torch.cat([next(r)[0] for r in resumed]), want_x)


def test_state_round_trips_through_dcp(tmp_path, shards):
    import torch.distributed.checkpoint as dcp

    first = loader(stream_of(shards), 4)
    take(first, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single process" notices
        dcp.save({"dataloader": first.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
        fresh = loader(stream_of(shards), 4)
        template = {"dataloader": fresh.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(template["dataloader"])
    assert_same(take(fresh, 60), take(first, 60))


def test_prefetch_gives_the_same_batches_and_forwards_errors(tmp_path, shards):
    prefetched = loader(stream_of(shards), 3)
    assert_same(take(prefetched, 80), take(loader(stream_of(shards), 3, prefetch=False), 80))
    prefetched.close()  # its thread must not read the shard rewritten below (a fault, SIGBUS, kills the process)
    path = shards.folder / "shard-00001.bin"
    raw = bytearray(path.read_bytes())
    raw[0:2] = (50_000).to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    corrupted = loader(stream_of(TokenShards(shards.folder), seed=None), 4)
    with pytest.raises(TitanliteError, match=r"shard-00001\.bin is corrupted"):
        take(corrupted, 20)
    corrupted.close()


def test_a_loader_dropped_without_close_stops_its_prefetch_thread(shards):
    """A thread that outlived its loader kept reading the memory-mapped shards, and a shard
    rewritten later (another test's tmp data) faulted the whole process (SIGBUS)."""
    import gc
    import threading

    before = set(threading.enumerate())
    dropped = loader(stream_of(shards), 3)
    take(dropped, 2)
    (thread,) = [t for t in threading.enumerate() if t.name == "titanlite-prefetch" and t not in before]
    del dropped
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_state_of_other_data_warns_and_keeps_the_position(shards, caplog):
    other = loader(stream_of(shards), 2)
    with caplog.at_level("WARNING", logger="titanlite"):
        other.load_state_dict({"windows": 10, "data": "something else", "seq_len": 99})
    assert "continuing at global window 10" in caplog.text and other.windows == 10
    with pytest.raises(
        TitanliteError, match="^checkpoint: the saved dataloader state is not a titanlite data position"
    ):
        other.load_state_dict({"source": "builtin"})


def test_prepared_loader_reads_a_folder_as_the_trainer_does_and_refuses_too_little_data(tmp_path, shards):
    """The library's one-call loader: the same windows as a hand-built stream over the folder."""
    from titanlite.data.loader import prepared_loader
    from titanlite.data.windows import window_count

    loader = prepared_loader(str(shards.folder), SEQ, 2, dp_rank=1, dp_degree=2, seed=7, prefetch=False)
    windows = DatasetWindows(shards, SEQ + 1, 0, window_count(shards, SEQ + 1), 7)
    reference = TokenWindowLoader(WindowStream([windows], [1.0], "test"), 2, 1, 2, prefetch=False)
    assert_same(take(loader, 3), take(reference, 3))
    small = make_prepared(tmp_path / "small", 10)
    with pytest.raises(TitanliteError, match="^prepared_loader: "):
        prepared_loader(str(small.folder), 15, 1)

"""titanlite/checkpoint/async_save.py: the staging of an async save reuses its buffers and copies
what the tensors held at staging."""

from __future__ import annotations

import torch


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

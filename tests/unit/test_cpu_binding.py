"""titanlite/runtime/cpu_binding.py on one process: `--cpu-bind` splits the usable cores into
one block per local rank (workers bound for real: tests/runs/test_launch.py)."""

from __future__ import annotations

from titanlite.runtime.cpu_binding import core_blocks


def test_cpu_bind_splits_the_cores_into_one_block_per_rank():
    assert core_blocks([0, 1], 2) == [[0], [1]]
    assert core_blocks([4, 5, 6, 7], 2) == [[4, 5], [6, 7]]
    assert core_blocks([0, 1, 2], 2) == [[0], [1]]
    assert core_blocks([0, 1], 4) == [[0], [1], [0], [1]]  # more ranks than cores: shared round-robin

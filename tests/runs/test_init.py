"""Shard-sized initialization (models/init.py): every layout holds the values one process
holds, each rank computes only its shard, and the distributions are the configured ones.

Layouts are checked on ranks of a fake process group (collectives are no-ops; DTensor
still computes each rank's shard), against DTensor's own slicing of the single-process
weights. One process per rank: DTensor caches layouts by mesh, so a process that became
several ranks in turn would keep its first rank's meshes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.distributed import REPO, run_env
from tests.unit.test_init import check_rank


@pytest.mark.parametrize("rank", [0, 1, 6, 7, 14, 15])  # first and last of each dp and tp dim
def test_every_rank_holds_its_slice_of_the_single_process_weights(rank):
    result = subprocess.run(
        [sys.executable, __file__, str(rank)], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


if __name__ == "__main__":
    failed = check_rank(int(sys.argv[1]))
    print("\n".join(failed))
    sys.exit(1 if failed else 0)

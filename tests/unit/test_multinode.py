"""Two nodes on one machine: two `run_train.sh` launchers (NNODES=2, 2 processes each)
meet through c10d rendezvous on 127.0.0.1 and train FSDP 2 x TP 2 across the 4 processes,
with the losses of one launcher running the same layout.

c10d numbers the nodes itself (the launcher that hosts the store first is not necessarily
node 0), so no node rank is passed: the test reads the ranks the agents were given.
"""

from __future__ import annotations

import subprocess

from tests.helpers.distributed import REPO, free_port, run_env


def test_several_nodes_without_a_rendezvous_endpoint_is_one_line(tmp_path):
    env = {k: v for k, v in run_env().items() if k != "RDZV_ENDPOINT"}
    result = subprocess.run([str(REPO / "run_train.sh")], cwd=REPO, env={**env, "NNODES": "2", "NPROC": "2"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "titanlite: error: NNODES=2 needs RDZV_ENDPOINT=host:port (the first node's address, the same on every node)"
    ]
    assert not result.stdout

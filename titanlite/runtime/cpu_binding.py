"""Each CPU worker on its own cores: `titanlite.launch --cpu-bind` (opt-in).

Unbound, the ranks of a CPU job and their helper threads (gloo's, the data prefetcher's)
float over all the host's cores, so one rank's gloo thread, busy moving the other rank's
bytes, takes time from a core where a rank computes. Bound, each rank and the threads it
starts stay on its block of cores: tensor-parallel runs, which wait on a collective after
every sub-layer, measured ~8% faster on 2 cores (docs/performance.md); data-parallel runs
neither gained nor lost. Opt-in because two jobs bound on one host would share the same
cores while others idle.

The launcher splits its own usable cores into contiguous blocks, one per local rank, and
hands them to the workers in `CPU_BIND_ENV`; each worker binds itself before torch starts
any thread (threads inherit their creator's affinity). This module imports nothing heavy,
so the command line can bind before it imports torch.
"""

from __future__ import annotations

import os

CPU_BIND_ENV = "TITANLITE_CPU_BIND"


def core_blocks(cores: list[int], processes: int) -> list[list[int]]:
    """`cores` split into `processes` contiguous blocks of equal size (the remainder unused);
    one core each when there are fewer cores than processes (then shared round-robin)."""
    per = max(1, len(cores) // processes)
    return [cores[(rank * per) % len(cores) : (rank * per) % len(cores) + per] for rank in range(processes)]


def encode(blocks: list[list[int]]) -> str:
    """The environment value: blocks separated by ';', cores by ','."""
    return ";".join(",".join(map(str, block)) for block in blocks)


def bind_from_env() -> list[int] | None:
    """Bind this process to its local rank's block from `CPU_BIND_ENV`; the cores, or None
    when the launcher did not ask (or this is not a launched worker)."""
    value, local_rank = os.environ.get(CPU_BIND_ENV), os.environ.get("LOCAL_RANK")
    if not value or local_rank is None:
        return None
    blocks = value.split(";")
    cores = [int(core) for core in blocks[int(local_rank) % len(blocks)].split(",")]
    os.sched_setaffinity(0, cores)
    return cores

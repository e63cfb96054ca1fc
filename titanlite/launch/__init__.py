"""`python -m titanlite.launch [torchrun args] -m titanlite.train ...`: torchrun, with one-line endings.

This is torchrun itself (`torch.distributed.run`): same flags, same c10d rendezvous, same
elastic agent and `--max-restarts`. It adds CPU thread and allocator settings for the workers and how a run ends.

On a host without GPUs the workers share its cores, so unless the caller set them:
OMP_NUM_THREADS = cores / processes (torchrun's own default is 1 thread per process),
OMP_WAIT_POLICY = PASSIVE and GOMP_SPINCOUNT = 1000: torch's CPU wheels run intra-op
parallelism on GNU OpenMP (libgomp, which MKL follows), whose idle threads by default spin
~3 ms after every parallel region and starve whatever else needs the cores (another rank,
gloo's threads, the data prefetcher), while never spinning (PASSIVE alone) puts every
thread to sleep between two kernels that follow each other within microseconds. A short
spin (1000 iterations, libgomp's GOMP_SPINCOUNT overrides the policy's count; other OpenMP
runtimes read only the policy) keeps both: docs/performance.md has the measurements.
libgomp reads these once, at start, so they must be in the workers' environment.
So does glibc's malloc, which by default serves every block over 32 MiB (and, past its
adaptive threshold, smaller ones) with a fresh mmap and returns it on free: a CPU training
step allocates and frees its activations, logits and gradients anew every step, and each
time the kernel maps and zeroes them again, page by page (55-63 thousand page faults per
debug-model step, ~5% of the step). A fixed MALLOC_MMAP_THRESHOLD_ of 32 MiB and
MALLOC_TRIM_THRESHOLD_ = 1 TiB keep every smaller freed block in the heap for the next step
(1-3 thousand faults), while blocks of 32 MiB and more (an FSDP unit's gathered weights, a
stack of experts' gradients) are mapped and given back: kept in the heap too (MALLOC_MMAP_MAX_
= 0, before issue 36), their holes, refilled by smaller blocks, made an MoE model's heap
outgrow one process's (docs/performance.md). glibc.malloc.hugetlb=1 (glibc >= 2.35; older
ones ignore it) maps those blocks with transparent huge pages where the kernel allows it
(madvise), one fault per 2 MiB instead of per 4 KiB.
`--cpu-bind` (opt-in) also binds each CPU worker to its own block of cores (runtime/cpu_binding.py).

How a run ends (`failures.py`: the one line of a failed job; `supervise.py`: stop signals
forwarded, unresponsive workers killed, restarts said, what torchrun's agent does otherwise):
one line and the first cause's exit code, whichever rank met it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import MutableMapping

import torch
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from titanlite.errors import USER_ERROR_EXIT_CODE
from titanlite.launch.failures import failure_line
from titanlite.launch.supervise import signal_line, supervise
from titanlite.parallel.distributed import usable_cores
from titanlite.runtime.cpu_binding import CPU_BIND_ENV, core_blocks, encode

_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


def _args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags torchrun's parser accepts but fails on later, and with ours."""
    nproc = str(args.nproc_per_node)
    if nproc not in _NPROC_WORDS and not (nproc.isdigit() and int(nproc) > 0):
        return (
            f"--nproc-per-node: expected a positive number of processes or one of {', '.join(_NPROC_WORDS)} (got "
            f"{nproc!r})"
        )
    if args.max_restarts < 0:
        return f"--max-restarts: expected 0 or more (got {args.max_restarts})"
    if args.cpu_bind and torch.cuda.is_available():
        return "--cpu-bind: for CPU workers only (this host has GPUs; see torchrun's --numa-binding)"
    if args.cpu_bind and not nproc.isdigit():
        return f"--cpu-bind: needs --nproc-per-node as a number (got {nproc!r})"
    return None


# glibc malloc: blocks under 32 MiB reused from the heap, never given back; larger ones mapped
# and returned on free, on huge pages (see the module docstring).
CPU_MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def set_cpu_worker_defaults(nproc_per_node: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Thread and allocator settings for CPU workers (see the module docstring) into `env`
    (this process's environment, which torchrun hands to the workers); values the caller
    set are kept."""
    if torch.cuda.is_available():
        return
    if nproc_per_node.isdigit():
        env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // int(nproc_per_node))))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("GOMP_SPINCOUNT", "1000")
    for name, value in CPU_MALLOC_DEFAULTS.items():
        env.setdefault(name, value)
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_TUNABLE}" if tunables else HUGE_PAGE_TUNABLE


def main(argv: list[str] | None = None) -> int:
    parser = get_args_parser()  # torchrun's flags, plus titanlite's own
    parser.add_argument(
        "--cpu-bind",
        "--cpu_bind",
        action="store_true",
        help="CPU workers only: bind each local rank (and the threads it starts) to its own block of this "
        "host's usable cores (titanlite/runtime/cpu_binding.py)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if problem := _args_problem(args):
        print(f"titanlite: error: {problem}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    if args.cpu_bind:  # the workers' core blocks into their environment
        os.environ[CPU_BIND_ENV] = encode(core_blocks(sorted(os.sched_getaffinity(0)), int(args.nproc_per_node)))
    supervise(args)
    set_cpu_worker_defaults(str(args.nproc_per_node))
    code = 0
    try:
        run(args)
    except ChildFailedError as error:
        line, code = failure_line(error.failures)
        print(line, file=sys.stderr)
    except SignalException as error:
        print(signal_line(error.sigval), file=sys.stderr)
        code = 128 + error.sigval
    # A signal leaves torch's rendezvous, and the keep-alive timer it holds, in a reference cycle.
    # Collect it here, on the main thread: a collection the timer's own thread ran would make the
    # timer's finalizer join that thread from itself and print a traceback at exit.
    gc.collect()
    return code

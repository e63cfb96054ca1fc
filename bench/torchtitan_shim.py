"""One torchrun worker of torchtitan 0.2.2's own trainer on CPU: bench/torchtitan_baseline.py's worker.

    torchrun --standalone --nproc-per-node N bench/torchtitan_shim.py [torchtitan's own flags]

Runs with torchtitan's venv (/work/tt-venv: torch 2.13 CPU, torchtitan 0.2.2 installed with
--no-deps), never titanlite's. It patches at run time only what stops torchtitan 0.2.2 from
running on a CPU-only host, and nothing on the training path: torchtitan's Trainer, its
llama3 Transformer, parallelize_llama (FSDP2, TP plans, loss parallel), pipeline_llm and
torch's schedules, its loss, AdamW container, LR schedule, gradient clipping and train step
run as released. The patches, each before the module that needs it is imported:

1. CPU binding and threads, the conditions titanlite's launcher gives its CPU workers
   (titanlite/runtime/cpu_binding.py, titanlite/parallel/distributed.py): this process,
   and every thread it starts later, on its local rank's block of cores from
   `TT_BASELINE_CPU_BIND` (the baseline script fills it with titanlite's `core_blocks`
   split); one inter-op thread. OMP_NUM_THREADS / OMP_WAIT_POLICY / GOMP_SPINCOUNT come
   in the environment from the baseline script.
2. `torchtitan.models.moe.kernels` imports `triton` at module level (a GPU-only package
   with no CPU wheel), through `import torchtitan` -> quantization -> float8 -> moe. A
   stand-in module takes its place in `sys.modules`; its two functions (MoE token
   permutation) raise if called, and the dense llama3 model never calls them. Faking
   `triton` itself would make torch believe triton is usable.
3. Device: `torchtitan.tools.utils` decides `device_type` once, at import, as
   `_get_available_device_type() or "cuda"`, so a CPU host gets "cuda" (and then the
   NCCL backend). While that module is imported, torch's two look-ups answer "cpu" and a
   CPU device module; they are restored right after. Every torchtitan module then reads
   device_type "cpu" (backend: torch's default for cpu, gloo; device meshes on cpu).
   `torch.cpu` lacks the memory-statistics calls torchtitan's DeviceMemoryMonitor makes,
   so the device module is `torch.cpu` plus those: the device's "memory" is this
   process's peak resident set (it cannot be reset, so it is the peak since start), its
   capacity the host's RAM; `current_device()` is 0 (barrier's device id on gloo).
4. Model flavor `titanlite_debugmodel`, added to torchtitan's own `llama3_args`: titanlite's
   Llama `debugmodel` (dim 256, 6 layers, 8 heads, 4 KV heads, vocab 4096 = titanlite's
   bundled tokenizer, rope_theta 500000; multiple_of 256 and no ffn_dim_multiplier, the
   defaults of both, so the SwiGLU width is 768 in both): 6,819,072 parameters, as titanlite's.
   (torchtitan's llama3 applies Llama 3.1 RoPE frequency scaling where titanlite's debug
   model has none: other rotation frequencies, the same computation.) And the same name in
   `deepseekv3_args`: torchtitan's own deepseek_v3 `debugmodel` (6 layers, dim 256, 16 MLA
   heads of 128 + 64 rotary, values 128, kv_lora_rank 512, 8 experts top-3 of width 256 +
   2 shared, softmax scores, the expert bias) with vocab 4096 instead of its 2048, so that
   titanlite's `torchtitan:debugmodel` trains the same shape from its bundled tokenizer:
   34,062,592 parameters in both (33,014,016 at torchtitan's vocab 2048). On CPU torchtitan
   runs the experts as its for loop (its `update_from_config` turns grouped_mm off below
   SM90), and attention through SDPA with its backend list (cuDNN, flash, math).
5. Data (`TT_BASELINE_DATA` synthetic, the default, or counting; any other value keeps
   torchtitan's own loader): torchtitan's `c4_test` files are not in the wheel (and the
   repository snapshot here lacks them), so the llama3 and deepseek_v3 train specs are
   registered again with a data loader of token ids of the run's shape and no tokenizer
   (with SDPA attention neither uses it). synthetic: uniform random ids; counting: each row
   counts up from a random id (a learnable next token, to see the loss fall). Each
   data-parallel rank has its own stream; inputs and labels are one window shifted by one
   token, as torchtitan's text dataset makes them. Shapes decide the cost; titanlite's
   loader reads pre-tokenized windows, so neither framework pays for tokenizing.
6. FSDP2 gradient reduction on gloo: torchtitan scales the loss by the global token count
   itself and turns FSDP's division off (`disable_fsdp_gradient_division`: divide factor
   1.0 on every FSDP module). With an explicit factor, torch's FSDP2 reduce-scatters with
   `ReduceOp.PREMUL_SUM(1 / factor)`, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM
   with Gloo"). The wrapper keeps torchtitan's function and then calls FSDP2's own
   `set_force_sum_reduction_for_comms(True)` on the same modules: a plain SUM, then a
   division by the factor, which torch skips for 1.0, so the gradients are the same sums
   PREMUL_SUM(1.0) gives, at no extra cost (titanlite does the same for its expert
   modules on gloo). llama4's apply_fsdp (which deepseek_v3 uses) imported the function by
   name, so its module's reference is replaced too.
7. MoE token counts: torchtitan's router and reorderer count tokens per expert with
   `torch.histc` over the int64 expert ids (bins = experts, range [0, experts]), which CUDA
   implements for integers and the CPU does not ("histogram_cpu" not implemented for 'Long').
   `torch.histc` on an integer CPU tensor over exactly that range is answered with
   `torch.bincount(ids, minlength=bins)`: the same counts in the same int64 dtype CUDA's histc
   returns for int64 input (torchtitan's expert loop reads them with `.tolist()` as split
   sizes); any other call goes to torch's own histc.
"""

from __future__ import annotations

import os
import sys
import types

BIND_ENV = "TT_BASELINE_CPU_BIND"  # blocks separated by ';', cores by ',' (titanlite's encoding)
DATA_ENV = "TT_BASELINE_DATA"
FLAVOR = "titanlite_debugmodel"


def bind_cpu() -> None:
    """Patch 1: this rank on its block of cores, before torch starts any thread."""
    value, local_rank = os.environ.get(BIND_ENV), os.environ.get("LOCAL_RANK")
    if value and local_rank is not None:
        blocks = value.split(";")
        os.sched_setaffinity(0, [int(core) for core in blocks[int(local_rank) % len(blocks)].split(",")])


bind_cpu()

import torch  # noqa: E402

if torch.get_num_interop_threads() != 1:
    torch.set_num_interop_threads(1)


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "CPU"


def cpu_device_module() -> types.ModuleType:
    """Patch 3's device module: torch.cpu plus the memory calls torchtitan makes."""
    module = types.ModuleType("torchtitan_cpu_device")
    module.__getattr__ = lambda name: getattr(torch.cpu, name)  # set_device, synchronize, ...
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.get_device_name = lambda device=None: _cpu_name()
    module.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total, name=_cpu_name())
    module.current_device = lambda: 0
    module.memory_stats = lambda device=None: {
        "active_bytes.all.peak": _peak_rss_bytes(),
        "reserved_bytes.all.peak": _peak_rss_bytes(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    return module


def stub_moe_kernels() -> None:
    """Patch 2: torchtitan.models.moe.kernels without its module-level `import triton`."""
    kernels = types.ModuleType("torchtitan.models.moe.kernels")

    def unavailable(*args, **kwargs):
        raise NotImplementedError(
            "torchtitan's MoE triton kernels are not available on this CPU host (bench/torchtitan_shim.py)"
        )

    kernels.generate_permute_indices = unavailable
    kernels.fill_indices_wrapper = unavailable
    kernels.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    sys.modules[kernels.__name__] = kernels


def import_torchtitan_on_cpu() -> None:
    """Patch 3: torchtitan.tools.utils (and through it every module) decides device "cpu"."""
    import torch._utils as torch_utils

    saved = torch_utils._get_available_device_type, torch_utils._get_device_module
    device_module = cpu_device_module()
    torch_utils._get_available_device_type = lambda: "cpu"
    torch_utils._get_device_module = lambda device_type=None: (
        device_module if device_type == "cpu" else saved[1](device_type)
    )
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        torch_utils._get_available_device_type, torch_utils._get_device_module = saved
    assert tt_utils.device_type == "cpu" and tt_utils.device_module is device_module, (
        tt_utils.device_type,
        tt_utils.device_module,
    )


class SyntheticTokens:
    """Patch 5: token windows of the run's shape (uniform random, or counting), forever; Stateful (unused)."""

    def __init__(self, dp_rank: int, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.batch_size, self.seq_len, self.vocab_size = batch_size, seq_len, vocab_size
        self.generator = torch.Generator().manual_seed(seed * 1000 + dp_rank)
        self.batches = 0

    def __iter__(self):
        counting = os.environ.get(DATA_ENV) == "counting"
        steps = torch.arange(self.seq_len + 1)
        while True:
            if counting:  # each row counts up from a random id: the next token is learnable
                starts = torch.randint(0, self.vocab_size, (self.batch_size, 1), generator=self.generator)
                window = (starts + steps) % self.vocab_size
            else:
                window = torch.randint(
                    0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=self.generator
                )
            self.batches += 1
            yield {"input": window[:, :-1]}, window[:, 1:]

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches = state_dict["batches"]


def register_flavor_and_data() -> None:
    """Patches 4 and 5."""
    import dataclasses

    import torchtitan.models.deepseek_v3 as deepseek_v3
    import torchtitan.models.llama3 as llama3
    import torchtitan.protocols.train_spec as train_spec_module
    from torchtitan.models.llama3 import TransformerModelArgs

    llama3.llama3_args[FLAVOR] = TransformerModelArgs(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=4096, rope_theta=500000
    )
    deepseek_v3.deepseekv3_args[FLAVOR] = dataclasses.replace(
        deepseek_v3.deepseekv3_args["debugmodel"], vocab_size=4096
    )
    if os.environ.get(DATA_ENV, "synthetic") not in ("synthetic", "counting"):
        return

    for name, family in (("llama3", llama3), ("deepseek_v3", deepseek_v3)):
        flavors = family.get_train_spec().model_args

        def build_synthetic(dp_world_size, dp_rank, tokenizer, job_config, flavors=flavors, **kwargs):
            training = job_config.training
            vocab = flavors[job_config.model.flavor].vocab_size
            return SyntheticTokens(
                dp_rank, training.local_batch_size, training.seq_len, vocab, job_config.debug.seed or 0
            )

        spec = dataclasses.replace(
            family.get_train_spec(), build_dataloader_fn=build_synthetic, build_tokenizer_fn=None
        )
        train_spec_module.register_train_spec(name, spec)  # user specs take priority over torchtitan's own


def fsdp_sum_on_gloo() -> None:
    """Patch 6: FSDP2 reduce-scatters with SUM where torchtitan's factor 1.0 asks for PREMUL_SUM."""
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize
    from torch.distributed.fsdp import FSDPModule

    original = llama3_parallelize.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    llama3_parallelize.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    llama4_parallelize.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def integer_histc_on_cpu() -> None:
    """Patch 7: torch.histc over integer expert ids on the CPU, as bincount."""
    histc = torch.histc

    def counting_histc(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 - torch's own names
        exact = not input.is_floating_point() and input.device.type == "cpu" and min == 0 and max == bins
        if exact and out is None:
            return torch.bincount(input.flatten(), minlength=bins)
        return histc(input, bins=bins, min=min, max=max, out=out) if out is not None else histc(input, bins, min, max)

    torch.histc = counting_histc


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    print(
        f"tt_baseline: rank {os.environ.get('RANK', 0)} cores {','.join(map(str, cores))} threads "
        f"{torch.get_num_threads()} "
        f"interop {torch.get_num_interop_threads()}",
        flush=True,
    )  # read by bench/torchtitan_baseline.py
    stub_moe_kernels()
    import_torchtitan_on_cpu()
    register_flavor_and_data()
    fsdp_sum_on_gloo()
    integer_histc_on_cpu()
    from torchtitan.train import Trainer, main as torchtitan_main

    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()

"""Building blocks for Megatron-style tensor-parallel plans, with or without sequence parallelism.

A model's plan (e.g. `models/decoder_tp.py`) is a dict for `parallelize_module`;
these helpers name the few layouts every such plan repeats, so a plan reads as "where
activations are sharded and where they are replicated".

Each attention / MLP sub-module runs colwise-then-rowwise linears on local head / hidden
shards; what differs is the residual stream between them:

- with sequence parallelism (`Shard(1)` between blocks), sub-modules all-gather the sequence
  on entry and reduce-scatter it on exit, and norms run on sequence shards: the activation
  memory outside attention / MLP is split tp ways;
- without it (`Replicate` between blocks), each rowwise exit all-reduces and every rank runs
  the norms on the whole sequence (backward all-reduces the input gradient at the entry).

Both move the same bytes on a backend with a native reduce-scatter (NCCL). Gloo has none:
its reduce-scatter clones the input, all-reduces it and copies out a slice, and its
all-gather goes through a flat buffer, so on CPU sequence parallelism costs an all-reduce
*plus* an all-gather and their copies per sub-layer (measured on 2 gloo ranks, 4 MiB:
reduce-scatter slower than all-reduce). `sequence_parallel_for` picks sequence parallelism
where it pays, off the CPU, unless `parallelism.sequence_parallel` says on or off (the tests
run it on gloo too, so the GPU plan is checked on this CPU).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor import parallel as torch_tp  # torch's styles, beside the float8-aware ones of their names
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel
from torch.distributed.tensor.placement_types import Placement

from titanlite.parallel.float8 import float8_tp_style

__all__ = [
    "ColwiseParallel",
    "ReplicateParallel",
    "WholeOnEachRank",
    "activations_layout",
    "block_entry",
    "norm",
    "norm_over_heads",
    "output_projection",
    "present",
    "rowwise_exit",
    "sequence_parallel_for",
    "vocab_sharded_embedding",
]


class _Float8Aware(ParallelStyle):
    """A plan's style that applies torchao's float8 form of itself where the module is trained
    in float8 under the tensorwise recipe (`float8.float8_tp_style`), else itself."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        float8 = float8_tp_style(self, module, device_mesh)
        return super()._apply(module, device_mesh) if float8 is None else float8._apply(module, device_mesh)


class ColwiseParallel(_Float8Aware, torch_tp.ColwiseParallel):
    """torch's ColwiseParallel; Float8ColwiseParallel on a tensorwise Float8Linear."""


class RowwiseParallel(_Float8Aware, torch_tp.RowwiseParallel):
    """torch's RowwiseParallel; Float8RowwiseParallel on a tensorwise Float8Linear."""


class PrepareModuleInput(_Float8Aware, torch_tp.PrepareModuleInput):
    """torch's PrepareModuleInput; PrepareFloat8ModuleInput before tensorwise Float8Linears only."""


class ReplicateParallel(ParallelStyle):
    """Every parameter a Replicate DTensor on the tp mesh, inputs read as replicated, the
    output left a DTensor (or, with `use_local_output`, this rank's plain tensor). For a module
    every rank computes in full: norms without sequence parallelism, GPT-2's position table,
    DeepSeek-V3's compressed latents. The backward of reading a plain input as Replicate
    all-reduces its Partial gradient, which is Megatron's entry all-reduce."""

    def __init__(self, use_local_output: bool = False) -> None:
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output_fn = (lambda _module, output, _mesh: output.to_local()) if self.use_local_output else None
        return distribute_module(module, device_mesh, input_fn=self._replicate_inputs, output_fn=output_fn)

    @staticmethod
    def _replicate_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            x
            if isinstance(x, DTensor) or not isinstance(x, Tensor)
            else DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            for x in inputs
        )


class _WaitedRowwiseParallel(torch_tp.RowwiseParallel):
    """RowwiseParallel whose output collective has completed when the module returns.

    For the embedding, whose output enters the first transformer block: under torch.compile
    that block must not receive the AsyncCollectiveTensor RowwiseParallel returns (torch
    2.13 then hands DTensor's Redistribute backward a plain tensor: "'Tensor' object has no
    attribute '_local_tensor'"). Waiting costs nothing here, the block needs the activations
    at once. Same signature as RowwiseParallel's (torch 2.11 and 2.13)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs


def sequence_parallel_for(tp_mesh: DeviceMesh, setting: str) -> bool:
    """`parallelism.sequence_parallel`: "on", "off", or "auto" = where the backend
    reduce-scatters natively (not gloo, on CPU)."""
    return tp_mesh.device_type != "cpu" if setting == "auto" else setting == "on"


def activations_layout(sequence_parallel: bool) -> Placement:
    """The residual stream between blocks: sequence shards, or the whole sequence on every rank."""
    return Shard(1) if sequence_parallel else Replicate()


def vocab_sharded_embedding(sequence_parallel: bool) -> torch_tp.RowwiseParallel:
    """Vocab-sharded embedding table whose partial lookups leave in the residual layout."""
    return _WaitedRowwiseParallel(input_layouts=Replicate(), output_layouts=activations_layout(sequence_parallel))


def norm(sequence_parallel: bool) -> ParallelStyle:
    """A norm (weights replicated) on sequence shards, or on the whole replicated sequence."""
    return SequenceParallel() if sequence_parallel else ReplicateParallel()


def norm_over_heads() -> SequenceParallel:
    """A norm over each attention head's features (per-head q and k norms), applied to the
    heads a colwise projection left on this rank ([batch, seq, local heads, head_dim]): the
    weight replicated, the input read as head shards (Shard(2)), the output handed back as
    the plain local heads. The weight's gradient is Partial (each rank saw its own heads) and
    is summed like a sequence-parallel norm's."""
    return SequenceParallel(sequence_dim=2, use_local_output=True)


class WholeOnEachRank(ParallelStyle):
    """A module every tp rank computes in full, on plain tensors (a mixture-of-experts layer,
    whose routing has no DTensor rules): its parameters become Replicate DTensors on the tp
    mesh (so every parameter shares the mesh the grad norm and FSDP see) and the module reads
    them as local tensors (`parallel/placement.local_tensor`); its buffers stay plain (the
    same values on every rank). Its first input arrives in the residual layout and is handed
    over as the whole sequence, a plain tensor (an all-gather of sequence shards under
    sequence parallelism); its output, the whole sequence, leaves in the residual layout (this
    rank's sequence shard: a slice, no communication). Gradients come back Replicate: every
    rank computed them in full from the same tokens."""

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.layout = activations_layout(sequence_parallel)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Not distribute_module: it would make the buffers DTensors too.
        for submodule in module.modules():
            for key, param in list(submodule._parameters.items()):
                if param is not None and not isinstance(param, DTensor):
                    replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
                    submodule.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(lambda mod, inputs: self._whole_input(mod, inputs, device_mesh))
        module.register_forward_hook(lambda mod, inputs, output: self._residual_output(mod, output, device_mesh))
        return module

    def _whole_input(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x, *rest = inputs
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.layout,), run_check=False)
        return (x.redistribute(mesh, (Replicate(),)).to_local(), *rest)

    def _residual_output(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        if isinstance(self.layout, Replicate):
            return output
        whole = DTensor.from_local(output, mesh, (Replicate(),), run_check=False)
        return whole.redistribute(mesh, (self.layout,)).to_local()


def block_entry(sequence_parallel: bool, extra_inputs: int = 0) -> PrepareModuleInput:
    """Entry of attention / MLP: the first input as Replicate (an all-gather of sequence
    shards, or nothing when the norm already left it replicated); `extra_inputs` pass through."""
    passthrough = (None,) * extra_inputs
    return PrepareModuleInput(
        input_layouts=(activations_layout(sequence_parallel), *passthrough),
        desired_input_layouts=(Replicate(), *passthrough),
    )


def rowwise_exit(sequence_parallel: bool) -> RowwiseParallel:
    """Last linear of attention / MLP: its partial sums reduce-scattered onto sequence shards,
    or all-reduced."""
    return RowwiseParallel(output_layouts=activations_layout(sequence_parallel))


def output_projection(loss_parallel: bool, sequence_parallel: bool) -> torch_tp.ColwiseParallel:
    """Vocab-sharded output head. With loss parallel the logits stay a vocab-sharded
    DTensor (never gathered); the loss must then run under `loss_parallel()`."""
    return torch_tp.ColwiseParallel(  # torch's: the head keeps the plain style whatever its linear (torchtitan's plan)
        input_layouts=activations_layout(sequence_parallel),
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


def present(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of a `parallelize_module` plan whose module this model holds: a pipeline
    stage (parallel/pipeline.py) has None where another stage's embedding or head would be."""

    def held(path: str) -> bool:
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                return False
        return True

    return {path: style for path, style in plan.items() if held(path)}

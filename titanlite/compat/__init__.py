"""One module per wrapper API users port from, each a thin signature over the FSDP2 core in
`titanlite.parallel.wrapper`: code written for it runs with only its import line changed.

- `titanlite.compat.fsdp1`: PyTorch FSDP1's `FullyShardedDataParallel` (and the names FSDP1
  code imports beside it);
- `titanlite.compat.hfai`: hfai's `FullyShardedDataParallel`;
- `titanlite.compat.megatron`: Megatron-core's `TorchFullyShardedDataParallel`.

docs/library.md has one table per API: what is supported, refused (why), or behaves differently.
"""

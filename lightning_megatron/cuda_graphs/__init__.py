"""Every CUDA graph of the package, behind one options object and one refusal table.

- `options`: `CudaGraphOptions`, parsed once from the options that name CUDA graphs: the strategy's `cuda_graph`
  and `cuda_graph_sequences_per_row`, `MTPOnlyCallback`'s `cuda_graph_trunk`.
- `refusals`: what each mechanism does not serve, one row each (the mechanism, the condition, the reason naming
  the option, the fix); the strategy, `MTPOnlyCallback` and both mechanisms ask it.
- `full_iteration` (`cuda_graph: full_iteration`, the strategy's): a training step's whole forward-backward
  captured once and replayed (Megatron-Core's `FullCudaGraphWrapper`): SFT with full or packed rows on one GPU.
- `frozen_trunk` (`cuda_graph_trunk`, `MTPOnlyCallback`'s): MTP-only training's frozen decoder forward replayed
  per input shape, through `graphed_forward`, which graphs any forward that records no autograd.

The two exclude each other: MTP-only training refuses the whole-iteration graph (it chooses in Python, step by
step, whether the main head runs; a replay would repeat one choice), and graphs its frozen trunk instead.
"""

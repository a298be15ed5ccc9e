"""What "MTP" (multi-token prediction) means, in one place.

- `parameters`: which parameters are MTP, freezing the rest, what MTP training needs, the per-step metrics.
- `skip_main_head`: MTP-only training without the main LM head's backward (and with token-chunked losses).
- `chunked_cross_entropy`: Megatron-Core's vocabulary-parallel cross-entropy, a chunk of tokens at a time.
- `self_distill`: the self-distillation MTP loss (KL to the detached main head) and the per-depth loss override.
- `tv_loss`: the TV loss (one minus the sampled acceptance) and a KL/TV hybrid, on `self_distill`'s machinery.
- `trunk_cache`: later epochs of MTP-only training from a cache of the frozen trunk's output.
- `acceptance`: the teacher-forced acceptance metrics logged in validation (greedy agreement, sampled `alpha`).
- `draft_capture`: both acceptances at every MTP depth, read off the model's own forward (validation, the probe).
- `probe`: the draft head's acceptance per weight version on a fixed probe set (`DraftProbe`, `DraftAcceptance`).
- `restore`: put an MTP head back into an HF checkpoint exported without one (safetensors only).

The HF names of each family's MTP tensors live in `lightning_megatron.families`. Nothing is imported here, so
`lightning_megatron.mtp.restore` loads neither Megatron-Core nor Lightning.
"""

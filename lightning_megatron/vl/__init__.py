"""Vision-language SFT (Qwen2.5-VL, Qwen3-VL), in one place.

- `bridge`: what the bridges must check and set for a VL checkpoint (read by `bridges.base` and the backends).
- `data`: `VLSFTDataModule`: images by path in chat JSONL, response-only masks, packed rows with each sequence's
  vision inputs.
- `module`: `VLSFTModule`, the `SFTModule` that feeds pixels through the vision tower.

The command is `lightning-megatron-vl` (`lightning_megatron.cli.vl`); tiny VL checkpoints are made by
`lightning_megatron.testing.vl`. Nothing is imported here, so the bridges can read `vl.bridge` without the module.
"""

"""Vision-language SFT (Qwen2.5-VL, Qwen3-VL): the module and its data.

- `data`: `VLSFTDataModule`: images by path in chat JSONL, response-only masks, packed rows with each sequence's
  vision inputs.
- `module`: `VLSFTModule`, the `SFTModule` that feeds pixels through the vision tower.

What the bridges check and set for a VL checkpoint lives beside them, in `lightning_megatron.bridges.vl`. The
command is `lightning-megatron-vl` (`lightning_megatron.cli.vl`); tiny VL checkpoints are made by
`lightning_megatron.testing.vl`.
"""

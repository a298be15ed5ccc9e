"""An installation check: a tiny HF checkpoint made here, through each bridge into Megatron-Core and back.

It proves the installation end to end on this machine (CPU or GPU): Megatron logits equal HF logits, and the
exported checkpoint equals the original tensor for tensor, with and without the MTP head.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from lightning_megatron import _compat
from lightning_megatron.distributed import init_single_process
from lightning_megatron.families import is_hf_mtp_tensor


def _round_trip(bridge_type: str, checkpoint: Path, out: Path, mtp: bool) -> dict[str, float | bool]:
    import transformers
    from safetensors.torch import load_file

    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    started = time.perf_counter()
    bridge = create_bridge(bridge_type, checkpoint)
    chunks = bridge.build(ModelOptions(mtp=mtp))
    loaded = time.perf_counter()
    input_ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model = chunks[0].eval()
    with torch.no_grad():
        device = next(model.parameters()).device
        logits = model(input_ids=input_ids.to(device), position_ids=torch.arange(32, device=device).expand(2, 32),
                       attention_mask=None).cpu()
        reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)(input_ids).logits
    saved_started = time.perf_counter()
    bridge.save_hf(chunks, out)
    saved = time.perf_counter()
    original, exported = load_file(checkpoint / "model.safetensors"), load_file(out / "model.safetensors")
    if not mtp:  # the head was dropped on purpose; the export's config says so
        original = {name: tensor for name, tensor in original.items() if not is_hf_mtp_tensor(name)}
    return {
        "max_abs_logit_diff": float((logits - reference).abs().max()),
        "export_bit_identical": original.keys() == exported.keys()
        and all(torch.equal(original[name], exported[name]) for name in original),
        "load_s": loaded - started,
        "save_s": saved - saved_started,
    }


def main() -> None:
    _compat.quiet_handled_warnings()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lightning_megatron_demo_"))

    import transformers

    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    init_single_process()
    checkpoint = make_tiny_checkpoint(workdir / "tiny-qwen3-mtp", "qwen3", mtp=True)
    print(f"tiny Qwen3 checkpoint with one MTP layer: {checkpoint}")
    rows = [
        ("mbridge", False),
        ("megatron-bridge", False),
        ("megatron-bridge", True),
    ]
    for bridge_type, mtp in rows:
        result = _round_trip(bridge_type, checkpoint, workdir / f"export-{bridge_type}-mtp{int(mtp)}", mtp)
        print(f"{bridge_type:16s} mtp={str(mtp):5s} logits vs HF max|diff| {result['max_abs_logit_diff']:.1e}  "
              f"export bit-identical to the original: {result['export_bit_identical']}  "
              f"load {result['load_s']:.2f}s save {result['save_s']:.2f}s")
        if not result["export_bit_identical"] or result["max_abs_logit_diff"] > 1e-4:
            raise SystemExit(f"{bridge_type}: the round trip is not exact")
    print(f"exports written under {workdir}")


if __name__ == "__main__":
    main()

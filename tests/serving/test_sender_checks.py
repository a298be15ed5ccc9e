"""The round trips of a small delta: the engine checks a sync's names, dtypes and shapes before any byte moves, but a
delta onto the sender's own last version, in tensors the engine accepted then, goes without that check (the engine
checks each request); after a failed sync (the engine then drops what it staged), or with other tensors, the check
comes back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.hf_io import checkpoint_tensor_specs
from lightning_megatron.serving import ColocatedSender, WeightReceiver
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint


class CountingReceiver(WeightReceiver):
    """The package's receiver, counting the manifest checks it answers."""

    checks = 0

    def validate_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        self.checks += 1
        return super().validate_weights(request)


def test_a_delta_of_accepted_tensors_onto_the_senders_last_version_skips_the_manifest_check(tmp_path):
    import transformers

    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_mtp", "qwen3", mtp=True)
    receiver = CountingReceiver(transformers.AutoModelForCausalLM.from_pretrained(checkpoint), checkpoint,
                                timeout_s=20).start()
    specs = checkpoint_tensor_specs(checkpoint)
    held = load_file(checkpoint / "model.safetensors")
    mtp = {name: specs[name] for name in specs if is_hf_mtp_tensor(name)}
    norms = {name: specs[name] for name in sorted(specs) if name.endswith("layernorm.weight")}
    sender = ColocatedSender(receiver.url, bucket_bytes=max(spec.nbytes for spec in mtp.values()), timeout_s=20,
                             device=torch.device("cpu"))

    def values(names: dict, shift: float) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, held[name] + shift) for name in names)

    def dies_half_way() -> Iterator[tuple[str, torch.Tensor]]:
        yield from list(values(mtp, 10.0))[:-1]  # more than a bucket: requests go out, staged by the engine
        raise RuntimeError("the trainer died")

    checks = []
    try:
        sender.sync(values(specs, 0.0), specs, 1, is_sender=True)
        checks.append(receiver.checks)
        sender.sync(values(mtp, 1.0), mtp, 2, is_sender=True, base_version=1)
        sender.sync(values(mtp, 2.0), mtp, 3, is_sender=True, base_version=2)
        checks.append(receiver.checks)  # the two deltas went without a check
        with pytest.raises(RuntimeError, match="the trainer died"):
            sender.sync(dies_half_way(), mtp, 4, is_sender=True, base_version=3)
        sender.sync(values(mtp, 3.0), mtp, 4, is_sender=True, base_version=3)
        checks.append(receiver.checks)  # checked: what the failed delta staged was dropped
        mtp_and_norms = {**mtp, **norms}
        sender.sync(values(mtp_and_norms, 4.0), mtp_and_norms, 5, is_sender=True, base_version=4)
        checks.append(receiver.checks)  # the norms were not among the tensors of the last delta: checked
        sender.sync(values(mtp, 5.0), mtp, 6, is_sender=True, base_version=5)
        checks.append(receiver.checks)  # the head's tensors were among the last delta's: not checked
        served = {name: receiver.named_tensors()[name] for name in specs}
    finally:
        sender.close()
        receiver.close()
    assert checks == [1, 1, 2, 3, 3]
    expected = {**{name: held[name] for name in specs}, **{name: held[name] + 4.0 for name in norms},
                **{name: held[name] + 5.0 for name in mtp}}
    assert [name for name in specs if not torch.equal(served[name], expected[name])] == []

"""Megatron-Core's GPT with an MTP layer trains on CPU, alone and with TP=2 over gloo."""

import pytest
import torch
import torch.nn.functional as F

from tests._distributed import run_distributed
from tests._megatron import tiny_gpt, token_batch


def _masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (per_token_loss * loss_mask).sum() / loss_mask.sum()


def _mtp_tracker_loss() -> float:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    value = float(MTPLossLoggingHelper.tracker["loss_values"][0])
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return value


def test_gpt_with_mtp_forward_backward(model_parallel):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.clean_metrics_in_tracker()  # process-global: earlier forwards accumulate into it
    model = tiny_gpt(mtp_layers=1)
    batch = token_batch()
    captured = {}
    model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))

    per_token = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"],
                      loss_mask=batch["loss_mask"])
    loss = _masked_mean(per_token, batch["loss_mask"])
    loss.backward()

    assert per_token.shape == batch["labels"].shape
    names_without_grad = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert names_without_grad == []
    assert any(name.startswith("mtp.layers.0.") for name, _ in model.named_parameters())

    # The MTP loss Megatron tracked is the masked cross-entropy of the MTP hidden states against token t+2.
    seq = batch["input_ids"].shape[1]
    mtp_hidden = captured["hidden"][seq:]  # [s, b, h]: the chunk after the main decoder's output
    logits, _ = model.output_layer(mtp_hidden)  # untied: the output layer's own weight
    targets = torch.roll(batch["labels"], -1, dims=1)
    mask = torch.roll(batch["loss_mask"], -1, dims=1)
    mask[:, -1] = 0
    ce = F.cross_entropy(logits.transpose(0, 1).reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                         reduction="none")
    expected = (ce * mask.reshape(-1)).sum() / mask.sum()
    assert _mtp_tracker_loss() == pytest.approx(float(expected), abs=1e-5)


def _tp_loss(rank: int, world_size: int, tensor_parallel_size: int) -> dict[str, float]:
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    parallel_state.initialize_model_parallel(tensor_parallel_size, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    torch.manual_seed(1234)
    model = tiny_gpt(mtp_layers=1)
    batch = token_batch()
    per_token = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"],
                      loss_mask=batch["loss_mask"])
    loss = _masked_mean(per_token, batch["loss_mask"])
    loss.backward()
    eh_proj_grad = model.mtp.layers[0].eh_proj.weight.grad
    result = {"loss": float(loss), "mtp_loss": _mtp_tracker_loss(), "eh_proj_rows": eh_proj_grad.shape[0],
              "eh_proj_grad_norm_sq": float(eh_proj_grad.pow(2).sum())}
    parallel_state.destroy_model_parallel()
    return result


def _tp2_then_tp1(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {"tp2": _tp_loss(rank, world_size, 2), "tp1": _tp_loss(rank, world_size, 1)}


@pytest.mark.slow
def test_tp2_with_mtp_matches_tp1(tmp_path):
    results = run_distributed(_tp2_then_tp1, tmp_path)
    for rank_result in results:
        tp1, tp2 = rank_result["tp1"], rank_result["tp2"]
        assert tp2["eh_proj_rows"] == tp1["eh_proj_rows"] // 2  # each rank holds half of the MTP projection
        assert tp2["loss"] == pytest.approx(tp1["loss"], abs=1e-6)
        assert tp2["mtp_loss"] == pytest.approx(tp1["mtp_loss"], abs=1e-6)
    # the two TP shards' gradients together are the TP=1 gradient
    shard_total = sum(result["tp2"]["eh_proj_grad_norm_sq"] for result in results)
    assert shard_total == pytest.approx(results[0]["tp1"]["eh_proj_grad_norm_sq"], rel=1e-5)

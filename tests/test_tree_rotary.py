"""Tree-packed rows through the model equal each sequence run alone: a rope GPT with the tree attention and the depth
rotary hook (and, as a negative control, without the hook it does not), then through `MegatronStrategy` with both
bridges at TP=1, TP=2 + sequence parallel and PP=2: logits, per-token losses, the loss and every gradient; chain-only
rows equal today's THD packing. The model-side guards name their fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.transformer import TransformerConfig
from torch.utils.data import DataLoader

from lightning_megatron.attention import with_core_attention
from lightning_megatron.data import TokenizedExample
from lightning_megatron.data.packing import first_fit, pack_examples, pad_example
from lightning_megatron.data.tree import build_tree_rows
from lightning_megatron.module import SFTModule
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.tree_rotary import install_depth_rotary
from tests._distributed import run_distributed

SEQ, VOCAB, PAD = 32, 128, 0


def _example(ids: list[int], prompt_length: int) -> TokenizedExample:
    mask = [False] * prompt_length + [True] * (len(ids) - prompt_length)
    return TokenizedExample("t", torch.tensor(ids), torch.tensor(mask, dtype=torch.bool))


def branched_examples() -> list[TokenizedExample]:
    """Two prompts; responses that branch at the prompt's end and deeper, a duplicate, one response ending inside
    another, and a one-token sequence."""
    prompt, other = [11, 12, 13, 14, 15, 16], [21, 22, 23]
    return [
        _example(prompt + [31, 32, 33, 34], 6), _example(prompt + [31, 32, 40, 41, 42], 6),
        _example(prompt + [50, 51], 6), _example(prompt + [31, 32, 33, 34], 6), _example(prompt + [31, 32], 6),
        _example(other + [60, 61, 62, 63], 3), _example(other + [70], 3), _example([5], 1),
    ]


def chain_examples() -> list[TokenizedExample]:
    """No two sequences share their first two tokens: every trie is a chain."""
    return [_example([100 + i] + [(7 * i + 3 * t) % 90 + 1 for t in range(4 + 2 * i)], 2) for i in range(5)]


def _microbatch(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.unsqueeze(0) if value.dim() == 1 and key != "cu_seqlens" else value
            for key, value in row.items()}


def layouts(examples: list[TokenizedExample], with_packed: bool) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The same sequences as tree rows, one padded row each and (for chains) today's THD packing."""
    result = {"tree": [_microbatch(row) for row in build_tree_rows(examples, SEQ, PAD).rows],
              "alone": [_microbatch(pad_example(example, SEQ, PAD)) for example in examples]}
    if with_packed:
        bins = first_fit([len(example) for example in examples], SEQ)
        result["packed"] = [_microbatch(pack_examples([examples[i] for i in members], SEQ, PAD)) for members in bins]
    return result


# --- a rope GPT, in this process ------------------------------------------------------------------------------


def _rope_gpt(mtp_layers: int = 0) -> GPTModel:
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               mtp_num_layers=mtp_layers or None)
    spec = with_core_attention(get_gpt_layer_local_spec(), "sdpa")
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp_layers else None
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    mtp_block_spec=mtp_spec).eval()


def _logits(model: GPTModel, row: dict[str, torch.Tensor], tree: bool) -> torch.Tensor:
    device = model.embedding.word_embeddings.weight.device
    microbatch = {key: value.to(device) for key, value in _microbatch(row).items()}
    return model(input_ids=microbatch["input_ids"], position_ids=microbatch["position_ids"],
                 attention_mask=microbatch["subtree_end"] if tree else None)[0].cpu()


def _max_path_difference(model: GPTModel, examples: list[TokenizedExample]) -> float:
    """Largest |logit| difference between each sequence's tree rows and the sequence run alone."""
    packing = build_tree_rows(examples, SEQ, PAD)
    tree_logits = [_logits(model, row, tree=True) for row in packing.rows]
    difference = 0.0
    for example, (row, path) in zip(examples, packing.paths):
        alone = _logits(model, pad_example(example, SEQ, PAD), tree=False)[: len(example)]
        difference = max(difference, float((tree_logits[row][path] - alone).abs().max()))
    return difference


def test_tree_rows_equal_each_sequence_alone_only_with_depth_rotary(model_parallel) -> None:
    torch.manual_seed(0)
    model = _rope_gpt()
    with torch.no_grad():
        without_fix = _max_path_difference(model, branched_examples())
        handles = install_depth_rotary([model])
        with_fix = _max_path_difference(model, branched_examples())
        for handle in handles:
            handle.remove()
        assert _max_path_difference(model, branched_examples()) == without_fix  # nothing else changed
    assert with_fix < 1e-5
    assert without_fix > 1e-3  # RoPE at flat indices: the negative control fails the equality


@pytest.mark.gpu
def test_flex_tree_attention_on_cuda_equals_each_sequence_alone_and_compiles_once(model_parallel) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = _rope_gpt().cuda()
    install_depth_rotary([model])
    with torch.no_grad():
        assert _max_path_difference(model, branched_examples()) < 1e-5  # fp32, flex_attention with the block mask
        compiled = counters["frames"]["ok"]
        for examples in (chain_examples(), branched_examples()[::-1]):  # other trees, same row length
            for row in build_tree_rows(examples, SEQ, PAD).rows:
                _logits(model, row, tree=True)
    assert counters["frames"]["ok"] == compiled  # no recompilation across microbatches


def test_the_model_refuses_tree_rows_it_cannot_run_exactly(model_parallel) -> None:
    model = _rope_gpt()
    install_depth_rotary([model])
    row = _microbatch(build_tree_rows(branched_examples(), SEQ, PAD).rows[0])
    inputs = dict(input_ids=row["input_ids"], position_ids=row["position_ids"], attention_mask=row["subtree_end"])
    with pytest.raises(ValueError, match="loss_mask: tree rows weigh"):
        model(**inputs, labels=row["labels"], loss_mask=row["loss_mask"] * 0.5)
    two_rows = {key: value.expand(2, -1) for key, value in inputs.items()}
    with pytest.raises(ValueError, match="micro_batch_size: tree rows run one per microbatch"):
        model(**two_rows)
    mtp_model = _rope_gpt(mtp_layers=1)
    install_depth_rotary([mtp_model])
    with pytest.raises(ValueError, match="enable_mtp: tree rows cannot go through the MTP head"):
        mtp_model(**inputs, labels=row["labels"], loss_mask=row["loss_mask"])


# --- through MegatronStrategy, both bridges, TP / TP + SP / PP ---------------------------------------------------


class LayoutComparison(SFTModule):
    """One training step that runs several layouts of the same sequences through `strategy.forward_backward` and
    keeps, per layout, the loss, the per-token losses and logits of each microbatch (last stage) and every
    gradient."""

    def __init__(self, layouts: dict[str, list[dict[str, torch.Tensor]]]) -> None:
        super().__init__(lr=1e-3)
        self.layouts = layouts
        self.results: dict[str, dict[str, Any]] = {}

    def training_step(self, microbatches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        for name, layout in self.layouts.items():
            self.results[name] = self._run(layout)
        return self.results["tree"]["lm_loss"]

    def _run(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        from megatron.core.utils import unwrap_model

        strategy = self.megatron_strategy
        per_token, logits = [], []

        def loss_func(microbatch: dict[str, torch.Tensor], output: torch.Tensor) -> Any:
            per_token.append(output.detach().clone())
            return self.loss_func(microbatch, output)

        last = unwrap_model(self.model[-1])
        handle = (last.output_layer.register_forward_hook(lambda _m, _a, out: logits.append(out[0].detach().clone()))
                  if last.post_process else None)
        try:
            metrics = strategy.forward_backward(microbatches, self.forward_step, loss_func)
        finally:
            if handle is not None:
                handle.remove()
        grads = {f"{index}.{name}": param.main_grad.detach().clone()
                 for index, chunk in enumerate(self.model) for name, param in unwrap_model(chunk).named_parameters()}
        return {"lm_loss": metrics["lm_loss"], "per_token": per_token, "logits": logits, "grads": grads}


def _compare(examples: list[TokenizedExample], results: dict[str, dict[str, Any]], has_loss: bool) -> dict:
    """Largest differences between the tree layout and the others, along every sequence's path."""
    packing = build_tree_rows(examples, SEQ, PAD)
    tree, alone = results["tree"], results["alone"]
    report = {"lm_loss": abs(float(tree["lm_loss"] - alone["lm_loss"])),
              "grads": max(float((tree["grads"][name] - grad).abs().max()) for name, grad in alone["grads"].items()),
              "grad_scale": max(float(grad.abs().max()) for grad in alone["grads"].values())}
    if "packed" in results:
        report["packed_lm_loss"] = abs(float(tree["lm_loss"] - results["packed"]["lm_loss"]))
    if has_loss:
        per_token, logits = 0.0, 0.0
        for index, (example, (row, path)) in enumerate(zip(examples, packing.paths)):
            n = len(example)
            if n > 1:  # a one-token sequence has no label
                per_token = max(per_token, float((tree["per_token"][row][0, path[:-1]]
                                                  - alone["per_token"][index][0, : n - 1]).abs().max()))
            # logits are [s, b, vocab / tp] on the last stage
            logits = max(logits, float((tree["logits"][row][path, 0] - alone["logits"][index][:n, 0]).abs().max()))
        report |= {"per_token": per_token, "logits": logits}
    return report


PARALLEL = {"tp1": {}, "tp2": dict(tensor_model_parallel_size=2),
            "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
            "pp2": dict(pipeline_model_parallel_size=2)}


def _strategy_case(rank: int, world_size: int, tmp: str, checkpoint: str) -> dict[str, dict]:
    from lightning_megatron.strategy import MegatronStrategy

    reports, alone = {}, {}
    cases = [("branched", branched_examples()), ("chain", chain_examples())]
    for bridge in ("mbridge", "megatron-bridge"):
        for name, parallel in PARALLEL.items():
            for data_name, examples in cases:
                if data_name == "chain" and name != "tp1":
                    continue
                strategy = MegatronStrategy(hf_checkpoint=checkpoint, bridge_type=bridge, precision="fp32",
                                            use_distributed_optimizer=False, **parallel)
                module = LayoutComparison(layouts(examples, with_packed=data_name == "chain"))
                trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=1,
                                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                     enable_model_summary=False, num_sanity_val_steps=0,
                                     default_root_dir=f"{tmp}/{bridge}-{name}-{data_name}")
                trainer.fit(module, DataLoader([{"input_ids": torch.zeros(SEQ, dtype=torch.int64)}] * world_size))
                has_loss = parallel_state.is_pipeline_last_stage()
                report = _compare(examples, module.results, has_loss)
                if data_name == "branched" and name.startswith("tp2"):  # SP changes nothing but the layout
                    alone[name] = module.results["alone"]
                if name == "tp2_sp" and data_name == "branched":
                    report["sequence_parallel_grads"] = max(
                        float((grad - alone["tp2"]["grads"][key]).abs().max())
                        for key, grad in alone["tp2_sp"]["grads"].items())
                    report["sequence_parallel_lm_loss"] = abs(float(alone["tp2_sp"]["lm_loss"]
                                                                    - alone["tp2"]["lm_loss"]))
                reports[f"{bridge}/{name}/{data_name}"] = report
    return reports


@pytest.mark.slow
def test_tree_rows_through_the_strategy_equal_each_sequence_alone(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    ranks = run_distributed(_strategy_case, tmp_path, str(tmp_path), str(checkpoint))
    for rank, reports in enumerate(ranks):
        assert len(reports) == 2 * (len(PARALLEL) + 1)
        assert all("sequence_parallel_grads" in reports[f"{bridge}/tp2_sp/branched"]
                   for bridge in ("mbridge", "megatron-bridge"))
        for case, report in reports.items():
            assert report["grad_scale"] > 1e-3, (rank, case)  # the gradients compared are not all zeros
            for key, difference in report.items():
                if key != "grad_scale":
                    assert difference < 1e-5, (rank, case, key, difference)

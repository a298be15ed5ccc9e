"""Training at every drafting depth with one MTP layer (`SFTModule(mtp_depths=K)`, Megatron-Core's repeated MTP
layer): loss and MTP-layer gradients of a K = 3 fit equal an explicit recursive computation (labels,
self-distillation and TV; padded and packed rows; per-depth weights; MTP-only and joint) at one process and at
TP=2 with sequence parallelism and PP=2; the export writes one MTP layer, named as a K = 1 export, that
restore-MTP and the speculative evaluator read, whose HF head applied recursively is what was trained at every
depth, and whose K-token drafts are greedy decoding; validation measures the first depth, as a one-depth model does.

The explicit computation applies the parts of the model's one MTP layer (`mtp.layers.0`: enorm, hnorm, eh_proj, the
transformer layer, final norm) three times to the inputs the MTP block received: depth k combines depth k - 1's
output at t (depth 0: the main decoder's) with the embedding of token t + k (the ids shifted by plain indexing,
within each sequence of a packed row); its logits are scored against token t + k + 1 (labels), or the detached
main head at t + k (self-distillation, TV), where the loss mask at t + k is set; then
`tests.mtp.test_self_distill`'s microbatch weighting per depth, each depth's share of `mtp_loss_scaling_factor` its
normalised weight. Gradients by autograd.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from lightning_megatron.bridges import create_bridge
from lightning_megatron.callbacks import HFExport
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.parameters import UntrainedDepths, is_mtp_parameter
from lightning_megatron.mtp.restore import restore_mtp_head
from lightning_megatron.options import ModelOptions
from lightning_megatron.speculative import greedy_decode, load_mtp_head, load_target, speculative_decode
from lightning_megatron.speculative.report import encode_prompt, eos_token_ids
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._distributed import run_distributed
from tests.mtp.test_mtp import _expect_rejection
from tests.mtp.test_restore import _split, _strip_mtp
from tests.mtp.test_self_distill import SCALE, TEMPERATURE, Gradients, _assert_equal, _batches, _fit, checkpoints  # noqa: F401  (the checkpoints fixture)
from tests.mtp.test_tv_loss import _per_token as _tv_per_token
from tests.speculative.test_sampling import _decided_before_each_step
from tests.speculative.test_speculative import PROMPTS
from tests.test_context_parallel import SequencesDataset

DEPTHS = 3
WEIGHTS = [3.0, 2.0, 1.0]


def _options(loss_type: str, weights: list[float] | None) -> dict[str, Any]:
    options: dict[str, Any] = {"mtp_depths": DEPTHS, "mtp_depth_weights": weights, "mtp_loss_type": loss_type}
    if loss_type == "tv":  # both heads at the sampling temperature; the teacher-only one stays 1
        options |= {"mtp_distill_temperature": 1.0, "mtp_sampling_temperature": TEMPERATURE}
    if loss_type == "labels":  # no teacher
        options |= {"mtp_distill_temperature": 1.0}
    return options


def _shifted(tensor: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """`[b, s, ...]` one token left within each sequence (`ends`: where each ends), a sequence's last position 0 (as
    Megatron-Core's roll leaves it: it is never scored)."""
    shifted = torch.cat([tensor[:, 1:], torch.zeros_like(tensor[:, :1])], dim=1)
    shifted[:, [end - 1 for end in ends]] = 0
    return shifted


def _sequence_ends(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["cu_seqlens"][1:].tolist() if "cu_seqlens" in batch else [batch["input_ids"].size(1)]


def _recursive_depths(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """The main decoder's hidden states and each depth's MTP output `[s, b, h]`, the one MTP layer's parts applied
    `DEPTHS` times to what the MTP block received in the model's own forward on `batch`."""
    from lightning_megatron.microbatch import model_inputs

    received: dict[str, Any] = {}
    hook = model.mtp.register_forward_pre_hook(lambda module, args, kwargs: received.update(kwargs), with_kwargs=True)
    model(**model_inputs(batch))
    hook.remove()
    (layer,) = model.mtp.layers  # one physical layer
    main = received["hidden_states"]
    hidden, ids, depths = main, received["input_ids"], []
    for _ in range(DEPTHS):
        ids = _shifted(ids, _sequence_ends(batch))
        embedded = received["embedding"](input_ids=ids, position_ids=received["position_ids"])
        mixed, _ = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(hidden)], dim=-1))
        mixed, _ = layer.mtp_model_layer(hidden_states=mixed, attention_mask=received["attention_mask"],
                                         rotary_pos_emb=received["rotary_pos_emb"],
                                         packed_seq_params=received["packed_seq_params"])
        hidden = layer.final_layernorm(mixed)
        depths.append(hidden)
    return main, depths


def _depth_loss(loss_type: str, mtp_logits: torch.Tensor, main_logits: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
    """Per position, the loss of logits `[b, s, V]` against token t + k + 1 (`labels`) or the main head predicting
    it (`main_logits`, the same positions)."""
    if loss_type == "labels":
        return F.cross_entropy(mtp_logits.transpose(1, 2), labels, reduction="none")
    if loss_type == "self_distill":
        log_q, log_p = F.log_softmax(mtp_logits, dim=-1), F.log_softmax(main_logits / TEMPERATURE, dim=-1)
        return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    return _tv_per_token(mtp_logits, main_logits, loss_type)


def _direct(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], loss_type: str,
            weights: list[float] | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """(logged metrics `mtp_loss` and `mtp_loss_depth_<k>`, MTP gradients) computed explicitly on whole rows."""
    shares = [1 / DEPTHS] * DEPTHS if weights is None else [weight / sum(weights) for weight in weights]
    tied = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    objective, per_depth, total_tokens = 0.0, [[] for _ in range(DEPTHS)], 0.0
    for batch in batches:
        main, depths = _recursive_depths(model, batch)
        with torch.no_grad():
            teacher = model.output_layer(main.detach(), weight=tied)[0].transpose(0, 1).float()
        mask = batch["loss_mask"].float()
        labels, depth_mask, ends = batch["labels"], mask, _sequence_ends(batch)
        for k, (hidden, share) in enumerate(zip(depths, shares), start=1):
            teacher, labels, depth_mask = (_shifted(tensor, ends) for tensor in (teacher, labels, depth_mask))
            mtp_logits = model.output_layer(hidden, weight=tied)[0].transpose(0, 1).float()
            loss = _depth_loss(loss_type, mtp_logits, teacher, labels)
            loss_sum, mtp_tokens = (loss * depth_mask).sum(), depth_mask.sum()
            objective = objective + SCALE * share * mask.sum() / mtp_tokens * loss_sum
            per_depth[k - 1].append(float(loss_sum / mtp_tokens))
        total_tokens += float(mask.sum())
    names, parameters = zip(*[(f"0.{name}", p) for name, p in model.named_parameters() if is_mtp_parameter(name)])
    gradients = dict(zip(names, torch.autograd.grad(objective / total_tokens, parameters)))
    depth_losses = [sum(values) / len(values) for values in per_depth]
    metrics = {f"mtp_loss_depth_{k}": value for k, value in enumerate(depth_losses, start=1)}
    return {"mtp_loss": sum(share * value for share, value in zip(shares, depth_losses)), **metrics}, gradients


class Direct(pl.Callback):
    """The explicit computation on the model about to be trained (1 process only), before its first step."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], loss_type: str, weights: list[float] | None) -> None:
        self.batches, self.loss_type, self.weights = batches, loss_type, weights

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        from megatron.core.utils import unwrap_model

        model = unwrap_model(pl_module.model[0])
        assert model.config.mtp_num_layers == DEPTHS and model.config.mtp_use_repeated_layer
        self.metrics, self.gradients = _direct(model, self.batches, self.loss_type, self.weights)
        self.mtp_loss = self.metrics["mtp_loss"]
        MTPLossLoggingHelper.clean_metrics_in_tracker()  # that forward is not a training step's


def _assert_depths_equal(gradients: dict[str, torch.Tensor], metrics: dict[str, float], direct: Direct) -> None:
    ours = Gradients()
    ours.gradients, ours.metrics = gradients, metrics
    _assert_equal(ours, direct)
    for name, value in direct.metrics.items():
        assert metrics[name] == pytest.approx(value, rel=0, abs=1e-6), name
    depth_losses = [direct.metrics[f"mtp_loss_depth_{k}"] for k in range(1, DEPTHS + 1)]
    assert min(abs(a - b) for a, b in itertools.pairwise(depth_losses)) > 1e-3  # three different depths


@pytest.mark.parametrize(("family", "loss_type", "packed", "mtp_only", "weights"),
                         [("qwen3", "labels", False, True, WEIGHTS), ("qwen3", "self_distill", False, False, None),
                          ("mimo", "self_distill", True, True, WEIGHTS), ("qwen3", "tv", True, False, [1.0, 0.0, 2.0])],
                         ids=["qwen3-labels-padded-mtp_only-weighted", "qwen3-self_distill-padded-joint-uniform",
                              "mimo-self_distill-packed-mtp_only-weighted", "qwen3-tv-packed-joint-a_zero_weight"])
def test_k_depth_training_equals_the_explicit_recursion_at_one_process(process_group, checkpoints, tmp_path, family,
                                                                       loss_type, packed, mtp_only, weights):
    dataset = SequencesDataset(packed, alignment=4, rows=4)
    direct = Direct(_batches(dataset), loss_type, weights)
    ours = _fit(tmp_path, checkpoints[family], dataset, mtp_only=mtp_only, callbacks=(direct,),
                module_kwargs=_options(loss_type, weights))
    _assert_depths_equal(ours.gradients, ours.metrics, direct)


PARALLEL = {"tp2_sp": ("self_distill", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
            "pp2": ("labels", dict(pipeline_model_parallel_size=2))}


def _parallel_fits(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict:
    results = {}
    for layout, (loss_type, parallel) in PARALLEL.items():
        fit = _fit(Path(tmp) / f"rank{rank}" / layout, hf_checkpoint, SequencesDataset(False, alignment=4, rows=4),
                   module_kwargs=_options(loss_type, WEIGHTS), **parallel)
        results[layout] = (getattr(fit, "gradients", {}), fit.metrics)
    return results


@pytest.mark.slow
def test_k_depth_training_equals_the_explicit_recursion_under_tp_and_pp(process_group, checkpoints, tmp_path):
    """One spawned pair of processes: self-distillation at TP=2 with sequence parallelism (the vocabulary and
    eh_proj split, the sequence scattered at every depth) and labels at PP=2 (the repeated layer on the last
    stage), both MTP-only with per-depth weights; each equals the explicit computation at one process."""
    ranks = run_distributed(_parallel_fits, tmp_path, str(tmp_path), checkpoints["qwen3"])
    for layout, (loss_type, _) in PARALLEL.items():
        dataset = SequencesDataset(False, alignment=4, rows=4)
        direct = Direct(_batches(dataset), loss_type, WEIGHTS)
        _fit(tmp_path / f"direct_{layout}", checkpoints["qwen3"], dataset, callbacks=(direct,),
             module_kwargs=_options(loss_type, WEIGHTS))
        if layout == "pp2":
            assert ranks[0][layout][0] == {}  # the first stage holds no MTP layer
        for result in ranks[1:] if layout == "pp2" else ranks:
            _assert_depths_equal(*result[layout], direct)


def _validate(workdir: Path, hf_checkpoint: str, depths: int) -> dict[str, float]:
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=hf_checkpoint, bridge_type="megatron-bridge",
                                                   micro_batch_size=1, global_batch_size=2, precision="fp32"),
                         accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1, default_root_dir=workdir)
    trainer.validate(SFTModule(enable_mtp=True, mtp_depths=depths),
                     DataLoader(SequencesDataset(False, alignment=4, rows=4), batch_size=1))
    return {key: float(value) for key, value in trainer.callback_metrics.items()}


def test_validation_measures_the_first_depth_as_with_one_depth(process_group, checkpoints, tmp_path):
    """With K = 3 the MTP block runs three depths in validation; the acceptance metrics are the first depth's
    draft, the same values as a one-depth model of the same checkpoint logs."""
    one, three = (_validate(tmp_path / f"k{depths}", checkpoints["qwen3"], depths) for depths in (1, 3))
    assert set(one) == set(three) == {"val_lm_loss", "val_mtp_acceptance", "val_mtp_sampled_acceptance"}
    assert three == pytest.approx(one, rel=0, abs=1e-6)


@pytest.fixture(scope="module")
def k_depth_export(process_group, checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF export of a K = 3 MTP-only fit (self-distillation, weighted depths) of the Qwen3 checkpoint, at a
    learning rate that moves the head."""
    root = tmp_path_factory.mktemp("k_depth_export")
    _fit(root / "fit", checkpoints["qwen3"], SequencesDataset(False, alignment=4, rows=4),
         callbacks=(HFExport(str(root / "export")),), module_kwargs=_options("self_distill", WEIGHTS) | {"lr": 1e-2})
    return root / "export"


def test_the_export_writes_one_mtp_layer_named_as_a_one_depth_export(model_parallel, checkpoints, k_depth_export,
                                                                      tmp_path):
    bridge = create_bridge("megatron-bridge", checkpoints["qwen3"])
    one_depth = bridge.save_hf(bridge.build(ModelOptions(mtp=True)), tmp_path / "one_depth")
    source, exported, reference = (load_file(Path(path) / "model.safetensors")
                                   for path in (checkpoints["qwen3"], k_depth_export, one_depth))
    assert {name: tuple(t.shape) for name, t in exported.items()} == {name: tuple(t.shape)
                                                                      for name, t in reference.items()}
    assert json.loads((k_depth_export / "config.json").read_text())["num_nextn_predict_layers"] == 1
    backbone, head = _split(exported)
    source_backbone, source_head = _split(source)
    assert all(torch.equal(tensor, source_backbone[name]) for name, tensor in backbone.items())  # MTP-only
    assert all(not torch.equal(tensor, source_head[name]) for name, tensor in head.items() if tensor.dim() > 1)


def test_the_exported_head_applied_recursively_is_what_was_trained_at_every_depth(model_parallel, k_depth_export):
    """The speculative evaluator's HF head, fed its own output at each depth (whole rows, no cache), equals the
    logits of a K = 3 Megatron model loaded from the export at every depth."""
    bridge = create_bridge("megatron-bridge", k_depth_export)
    model = bridge.build(ModelOptions(mtp=True, mtp_depths=DEPTHS))[0].eval()
    assert len(model.mtp.layers) == 1
    captured = {}
    model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    seq = ids.shape[1]
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(seq).expand_as(ids), attention_mask=None)
        megatron = [model.output_layer(depth)[0].transpose(0, 1) for depth in captured["hidden"].chunk(1 + DEPTHS)[1:]]
        target = load_target(k_depth_export)
        head = load_mtp_head(k_depth_export, target)
        hidden = target.model(input_ids=ids).last_hidden_state
        positions = torch.arange(seq).expand_as(ids)
        for k, logits in enumerate(megatron, start=1):
            hidden = head.hidden(hidden[:, : seq - k], ids[:, k:], positions[:, : seq - k])
            assert (head.lm_head(hidden) - logits[:, : seq - k]).abs().max() <= 1e-5, f"depth {k}"


def test_restore_mtp_and_k_token_drafts_read_the_export(k_depth_export, tmp_path):
    """An mtp=False copy of the export gets the K-depth head back from it bit for bit, and the speculative decoder
    drafting K = 1..3 tokens with that head decodes exactly greedy."""
    finetuned = _strip_mtp(k_depth_export, tmp_path / "finetuned")
    restored = restore_mtp_head(finetuned, tmp_path / "restored", source=k_depth_export)
    written, exported = load_file(restored / "model.safetensors"), load_file(k_depth_export / "model.safetensors")
    assert written.keys() == exported.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in exported.items())
    assert json.loads((restored / "config.json").read_text())["num_nextn_predict_layers"] == 1

    target = load_target(restored)
    head = load_mtp_head(restored, target)
    tokenizer = AutoTokenizer.from_pretrained(restored)
    eos, new_tokens = eos_token_ids(restored, tokenizer), 16
    for prompt in (encode_prompt(tokenizer, text) for text in PROMPTS[:2]):
        greedy = greedy_decode(target, prompt, new_tokens, eos)
        for drafts in (1, 2, 3):
            speculative = speculative_decode(target, head, prompt, new_tokens, eos, num_draft_tokens=drafts)
            assert speculative.tokens == greedy.tokens
            assert len(speculative.accepted) == sum(min(drafts, new_tokens - 1 - decided)
                                                    for decided in _decided_before_each_step(speculative))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mtp_depths": 0}, "mtp_depths: 0 must be an integer >= 1"),
    ({"mtp_depths": 3, "mtp_depth_weights": [1.0, 1.0]},
     r"mtp_depth_weights: .* has 2 entries; give one per depth \(mtp_depths: 3\)"),
    ({"mtp_depths": 2, "mtp_depth_weights": [1.0, -1.0]}, "mtp_depth_weights: .* must be finite, >= 0"),
    ({"mtp_depths": 2, "mtp_depth_weights": [0.0, 0.0]}, "not all 0"),
    ({"mtp_depths": 3, "mtp_depth_weights": "3,2,1"}, r"mtp_depth_weights: '3,2,1' must be a list of numbers, one "
                                                     r"per depth \(mtp_depths: 3, e.g. \[3.0, 2.0, 1.0\]\)"),
    ({"mtp_depths": 2, "mtp_depth_weights": "12"}, "mtp_depth_weights: '12' must be a list of numbers"),
    ({"mtp_depth_weights": 2.0}, "mtp_depth_weights: 2.0 must be a list of numbers"),
    ({"mtp_depths": 2, "mtp_depth_weights": [1.0, None]}, r"mtp_depth_weights: \[1.0, None\] must be a list of"),
    ({"mtp_depths": 2, "enable_mtp": False}, "mtp_depths: 2 trains the MTP head at 2 depths; it needs enable_mtp"),
    ({"mtp_depths": 2, "enable_mtp_training": False}, "it needs enable_mtp: true with MTP training"),
])
def test_bad_depth_options_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SFTModule(**({"enable_mtp": True} | kwargs))


def test_depths_the_rows_are_too_short_for_are_named(process_group, checkpoints, tmp_path):
    """Rows of 4 tokens (the first a prompt) leave depth 3 one trained token and depths 4 and 5 none: the fit runs
    and says which depths train nothing, whose logged losses read 0."""
    with pytest.warns(UserWarning, match=r"mtp_depths: 5: depth\(s\) 4-5 had no trained token .*Lower mtp_depths"):
        fit = _fit(tmp_path, checkpoints["qwen3"], RandomTokenDataset(2, 4, 384),
                   module_kwargs=_options("labels", None) | {"mtp_depths": 5})
    assert fit.metrics["mtp_loss_depth_5"] == fit.metrics["mtp_loss_depth_4"] == 0 < fit.metrics["mtp_loss_depth_3"]


def test_untrained_depths_name_the_first_step_that_had_any_and_its_depths():
    """Recorded step by step on the device and read once: the first step with an untrained depth and that step's
    untrained depths, as the warning said them when it read every step."""
    depths = UntrainedDepths()
    assert depths.first() is None
    depths.record(torch.tensor([False, False, False]), 0)
    assert depths.first() is None
    depths.record(torch.tensor([False, True, True]), 1)
    depths.record(torch.tensor([True, True, True]), 2)
    assert depths.first() == (1, [2, 3])


def test_huge_depth_weights_keep_their_ratios():
    """Only the ratios count: weights whose sum overflows still share the MTP loss as they say."""
    assert SFTModule(enable_mtp=True, mtp_depths=2, mtp_depth_weights=[1e308, 3e307])._depth_weights == \
        pytest.approx((1 / 1.3, 0.3 / 1.3), rel=1e-12)


def test_a_checkpoint_of_two_mtp_layers_is_still_refused_naming_mtp_depths(process_group, tmp_path):
    """MTP-only training keeps its rule of exactly one physical MTP layer; the depths are its applications."""
    two_layers = make_tiny_checkpoint(tmp_path / "two_mtp_layers", "qwen3", mtp=True)
    config = json.loads((two_layers / "config.json").read_text())
    (two_layers / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    _expect_rejection(tmp_path, two_layers, r"supports exactly one MTP layer; the checkpoint declares 2 .*keep one "
                                            r"layer and set SFTModule\(mtp_depths=K\)",
                      module_kwargs={"mtp_depths": 2})


def test_mbridge_refuses_k_depths_naming_megatron_bridge(process_group, checkpoints, tmp_path):
    _expect_rejection(tmp_path, checkpoints["qwen3"], "mtp_depths: 3 .*bridge_type: mbridge cannot build; set "
                                                      "bridge_type: megatron-bridge",
                      bridge_type="mbridge", module_kwargs={"mtp_depths": 3}, mtp_only=False)

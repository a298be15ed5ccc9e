"""Speculative decoding with the MTP head as drafter: same tokens as greedy, acceptance equal to a brute-force
replay, an HF-side head equal to the reference and to Megatron's MTP, a pooled validation metric, the report and
the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoTokenizer

from lightning_megatron.speculative import (
    MTPAcceptanceAccuracy,
    greedy_decode,
    load_mtp_head,
    load_target,
    measure,
    measure_checkpoint,
    read_prompts,
    reference_accepts,
    speculative_decode,
    write_report,
)
from lightning_megatron.speculative.report import encode_prompt, eos_token_ids
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "What is the capital of France?",
    "Can you write a function that adds two numbers?",
    "How do I run the tests?",
    "Tensor parallelism splits each weight matrix",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest, and several fight over the machine's two shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("speculative")
    return {
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3", mtp=True),
        "mimo": make_tiny_checkpoint(root / "mimo", "mimo", mtp=True),
        "qwen3_tied": make_tiny_checkpoint(root / "qwen3_tied", "qwen3", mtp=True, tied=True),
        "qwen3_no_mtp": make_tiny_checkpoint(root / "qwen3_no_mtp", "qwen3"),
        "glm4_moe": make_tiny_checkpoint(root / "glm4_moe", "glm4_moe", mtp=True),
        "qwen3_5": make_tiny_checkpoint(root / "qwen3_5", "qwen3_5_text", mtp=True),
    }


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """Per checkpoint: the target, its MTP head as stored, the encoded prompts and the end-of-sequence ids."""
    result = {}
    for name in ("qwen3", "mimo", "qwen3_tied", "glm4_moe", "qwen3_5"):
        target = load_target(checkpoints[name])
        tokenizer = AutoTokenizer.from_pretrained(checkpoints[name])
        prompts = [encode_prompt(tokenizer, prompt) for prompt in PROMPTS]
        result[name] = (target, load_mtp_head(checkpoints[name], target), prompts,
                        eos_token_ids(checkpoints[name], tokenizer))
    return result


def _no_cache_mtp_logits(target, head, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state
        positions = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
        return head(hidden[:, :-1], ids[:, 1:], positions)


def _random_ids(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 384, (2, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["qwen3", "mimo", "qwen3_tied", "glm4_moe"])
def test_head_equals_the_hf_reference_with_and_without_its_cache(checkpoints, loaded, name):
    from transformers import DynamicCache

    target, head, _, _ = loaded[name]
    ids = _random_ids()
    full = _no_cache_mtp_logits(target, head, ids)
    assert (full - hf_mtp_reference_logits(checkpoints[name], ids)).abs().max() <= 1e-5

    cache, pieces = DynamicCache(), []
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state
        for start, stop in [(0, 6), (6, 7), (7, 9), (9, 15)]:  # prefill, then 1- and 2-position steps
            positions = torch.arange(start, stop).expand(2, -1)
            pieces.append(head(hidden[:, start:stop], ids[:, start + 1 : stop + 1], positions, cache))
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["qwen3", "mimo", "glm4_moe"])
def test_head_equals_megatrons_mtp_logits(model_parallel, checkpoints, loaded, name):
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    target, head, _, _ = loaded[name]
    model = create_bridge("megatron-bridge", checkpoints[name], trust_remote_code=name == "mimo").build(
        ModelOptions(mtp=True))[0].eval()
    captured = {}
    model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))
    ids = _random_ids()
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
        megatron_logits, _ = model.output_layer(captured["hidden"][ids.shape[1]:])  # [s, b, V], after the main part
    difference = megatron_logits.transpose(0, 1)[:, :-1] - _no_cache_mtp_logits(target, head, ids)
    assert difference.abs().max() <= 1e-5


def _assert_matches_greedy_and_brute_force(target, head, prompt, max_new_tokens, eos):
    greedy = greedy_decode(target, prompt, max_new_tokens, eos)
    speculative = speculative_decode(target, head, prompt, max_new_tokens, eos)
    assert speculative.tokens == greedy.tokens
    assert speculative.accepted == reference_accepts(target, head, prompt, greedy.tokens, max_new_tokens, eos)
    # every verification step decides one token, plus one more per accepted draft; the prefill decides the first
    steps = speculative.target_forwards - 1
    ended_on_accepted_eos = len(speculative.tokens) == steps + sum(speculative.accepted)
    assert len(speculative.tokens) == 1 + steps + sum(speculative.accepted) - ended_on_accepted_eos
    assert len(speculative.accepted) <= steps
    return greedy, speculative


@pytest.mark.parametrize("name", ["qwen3", "mimo", "glm4_moe", "qwen3_5"])
def test_random_head_decodes_exactly_greedy_with_near_zero_acceptance(loaded, name):
    target, head, prompts, eos = loaded[name]
    drafts = accepted = 0
    for prompt in prompts:
        for max_new_tokens in (1, 2, 3):
            greedy, speculative = _assert_matches_greedy_and_brute_force(target, head, prompt, max_new_tokens, eos)
            assert len(speculative.accepted) == max(0, max_new_tokens - 2)  # no draft that could not be emitted
        greedy, speculative = _assert_matches_greedy_and_brute_force(target, head, prompt, NEW_TOKENS, eos)
        hf = target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=sorted(eos), pad_token_id=0)[0, len(prompt):].tolist()
        assert greedy.tokens == hf  # and plain greedy is what transformers' own generate gives
        drafts, accepted = drafts + len(speculative.accepted), accepted + sum(speculative.accepted)
    assert drafts >= len(prompts) * (NEW_TOKENS // 2)
    assert accepted / drafts < 0.2


def _train_on_own_continuations(path: Path, target, prompts, steps: int = 120):
    """A fresh copy of the stored head, fitted by plain PyTorch to the target's greedy token two ahead on the target's
    own greedy continuations of ``prompts``: a head that drafts right most of the time on exactly these prompts."""
    head = load_mtp_head(path, target)
    sequences = [prompt + greedy_decode(target, prompt, NEW_TOKENS, set()).tokens for prompt in prompts]
    length = min(map(len, sequences))
    ids = torch.tensor([sequence[:length] for sequence in sequences])
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state
        target_greedy = target.lm_head(hidden).argmax(dim=-1)
    shared = ("embed_tokens.", "lm_head.", "rotary_emb.")
    trainable = [p for n, p in head.named_parameters() if not n.startswith(shared)]
    optimizer = torch.optim.Adam(trainable, lr=3e-3)
    positions = torch.arange(length - 1).expand(len(prompts), -1)
    with torch.enable_grad():
        for p in head.parameters():
            p.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)
        for _ in range(steps):
            logits = head(hidden[:, :-1], ids[:, 1:], positions)  # position t drafts the target's greedy t+2
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target_greedy[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in head.parameters():
        p.requires_grad_(False)
    return head.eval(), ids, hidden, target_greedy


@pytest.mark.parametrize("name", ["qwen3", "mimo", "qwen3_5"])
def test_fitted_head_is_accepted_and_still_decodes_exactly_greedy(checkpoints, loaded, name):
    target, random_head, prompts, eos = loaded[name]
    head, ids, hidden, target_greedy = _train_on_own_continuations(checkpoints[name], target, prompts)
    drafts = accepted = 0
    for prompt in prompts:
        greedy, speculative = _assert_matches_greedy_and_brute_force(target, head, prompt, NEW_TOKENS, eos)
        drafts, accepted = drafts + len(speculative.accepted), accepted + sum(speculative.accepted)
        # an end-of-sequence token anywhere in the output, reached as a draft or as a verified token, stops both
        for stop_token in set(greedy.tokens[1:8]):
            _, stopped = _assert_matches_greedy_and_brute_force(target, head, prompt, NEW_TOKENS, {stop_token})
            assert stopped.tokens == greedy.tokens[: greedy.tokens.index(stop_token) + 1]
    assert accepted / drafts > 0.6

    # the teacher-forced metric agrees on the same sequences: high for the fitted head, near zero for the stored one
    def metric_for(mtp_head):
        metric = MTPAcceptanceAccuracy()
        positions = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
        with torch.no_grad():
            metric.update(mtp_head(hidden[:, :-1], ids[:, 1:], positions), target_greedy, torch.ones_like(ids))
        return float(metric.compute())

    assert metric_for(head) > 0.8 and metric_for(random_head) < 0.2


def _direct_acceptance(mtp_ids: torch.Tensor, main_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    accepted = counted = 0
    for b in range(main_ids.shape[0]):
        for t in range(main_ids.shape[1] - 1):
            if loss_mask[b, t + 1]:
                counted += 1
                accepted += int(mtp_ids[b, t] == main_ids[b, t + 1])
    return accepted, counted


def test_metric_counts_exactly_the_documented_positions():
    generator = torch.Generator().manual_seed(0)
    main = torch.randn(3, 10, 5, generator=generator)
    mtp = torch.randn(3, 10, 5, generator=generator)
    agree = torch.rand(3, 9, 1, generator=generator) < 0.5  # push about half the drafts onto the target's greedy
    mtp[:, :-1] += 3 * torch.nn.functional.one_hot(main[:, 1:].argmax(-1), 5) * agree
    mask = (torch.rand(3, 10, generator=generator) < 0.7).long()
    accepted, counted = _direct_acceptance(mtp.argmax(-1), main.argmax(-1), mask)
    assert 0 < accepted < counted

    for mtp_input in (mtp, mtp[:, :-1], mtp.argmax(-1)):  # full Megatron length, HF reference length, ids
        metric = MTPAcceptanceAccuracy()
        metric.update(mtp_input, main, mask)
        assert metric.compute().item() == pytest.approx(accepted / counted)
    changed = mtp.clone()
    changed[:, -1] = -changed[:, -1]  # the last MTP position is ignored
    metric = MTPAcceptanceAccuracy()
    metric.update(changed, main.argmax(-1), mask)
    assert metric.compute().item() == pytest.approx(accepted / counted)

    empty = MTPAcceptanceAccuracy()
    empty.update(mtp, main, torch.zeros_like(mask))
    assert torch.isnan(empty.compute())
    with pytest.raises(ValueError, match="loss_mask must be"):
        MTPAcceptanceAccuracy().update(mtp, main, mask[:, :-1])
    with pytest.raises(ValueError, match="mtp must have"):
        MTPAcceptanceAccuracy().update(mtp[:, :-2], main, mask)


class _Validated(L.LightningModule):
    """The metric inside validation_step, as a training module would use it."""

    def __init__(self, target, head) -> None:
        super().__init__()
        self.target, self.head = target, head
        self.mtp_acceptance = MTPAcceptanceAccuracy()

    def validation_step(self, batch, batch_index):
        ids, loss_mask = batch
        hidden = self.target.model(input_ids=ids).last_hidden_state
        positions = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
        self.mtp_acceptance.update(self.head(hidden[:, :-1], ids[:, 1:], positions), self.target.lm_head(hidden),
                                   loss_mask)
        self.log("val_mtp_acceptance", self.mtp_acceptance, on_step=False, on_epoch=True)


def test_metric_in_validation_step_is_pooled_over_the_epoch(checkpoints, loaded):
    target, head, _, _ = loaded["qwen3"]
    trained, ids, _, _ = _train_on_own_continuations(checkpoints["qwen3"], target, loaded["qwen3"][2], steps=60)
    # the fitted head's own sequences, all counted, then random tokens with few positions counted: the two batches'
    # rates differ, and so do pooling over tokens and averaging per batch
    random_ids, few = _random_ids(12), torch.zeros(2, 12, dtype=torch.long)
    few[:, 3:5] = 1
    batches = torch.utils.data.DataLoader([(ids, torch.ones_like(ids)), (random_ids, few)], batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    logged = trainer.validate(_Validated(target, trained), dataloaders=batches, verbose=False)[0]

    per_batch = []
    totals = [0, 0]
    with torch.no_grad():
        for batch_ids, mask in batches:
            hidden = target.model(input_ids=batch_ids).last_hidden_state
            positions = torch.arange(batch_ids.shape[1] - 1).expand(batch_ids.shape[0], -1)
            mtp_ids = trained(hidden[:, :-1], batch_ids[:, 1:], positions).argmax(-1)
            accepted, counted = _direct_acceptance(mtp_ids, target.lm_head(hidden).argmax(-1), mask)
            per_batch.append(accepted / counted)
            totals = [totals[0] + accepted, totals[1] + counted]
    assert logged["val_mtp_acceptance"] == pytest.approx(totals[0] / totals[1])
    assert per_batch[0] > 0.8 > per_batch[1]
    assert abs(sum(per_batch) / 2 - totals[0] / totals[1]) > 0.1


def test_report_json_and_png(loaded, tmp_path):
    target, head, prompts, eos = loaded["mimo"]
    report = measure(target, head, prompts[:3], 12, eos)
    json_path, png_path = write_report(report, tmp_path / "out")
    assert json.loads(json_path.read_text()) == report
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "speculative.png"]

    summary, rows = report["summary"], report["prompts"]
    assert summary["all_identical"] and all(row["identical"] for row in rows)
    for key in ("drafts", "accepted", "new_tokens", "verification_steps"):
        assert summary[key] == sum(row[key] for row in rows)
    assert summary["acceptance_rate"] == summary["accepted"] / summary["drafts"]
    assert summary["mean_accepted_length"] == pytest.approx(1 + summary["accepted"] / summary["verification_steps"])
    for row, prompt in zip(rows, prompts[:3]):
        assert row["prompt_tokens"] == len(prompt) and 1 <= row["new_tokens"] <= 12
        assert len(row["accepted_flags"]) == row["drafts"] and row["accepted_flags"].count("1") == row["accepted"]
        assert row["speculative_tokens_per_s"] > 0 and row["greedy_tokens_per_s"] > 0


def test_cli_writes_the_report(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n\n"
                       + json.dumps({"messages": [{"role": "system", "content": "Answer briefly."},
                                                  {"role": "user", "content": PROMPTS[1]}]}) + "\n")
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_megatron.cli.speculative", str(checkpoints["qwen3"]), str(prompts),
         "--out", str(tmp_path / "out"), "--max-new-tokens", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["mtp_layout"] == "qwen3" and report["summary"]["prompts"] == 2
    assert report["summary"]["all_identical"]
    assert "acceptance" in completed.stdout and (tmp_path / "out" / "speculative.png").is_file()
    in_process = measure_checkpoint(checkpoints["qwen3"], read_prompts(prompts), max_new_tokens=8)
    assert [row["completion"] for row in in_process["prompts"]] == [row["completion"] for row in report["prompts"]]


def test_cli_temperature_zero_is_greedy_verification(checkpoints, tmp_path, capsys):
    """`--temperature 0`, the greedy case the README names: the sampled runs verify greedily, so every draft count's
    acceptance and accepted length equal the greedy runs'; a negative temperature is refused."""
    from lightning_megatron.cli.speculative import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS[:2]))
    assert main([str(checkpoints["qwen3"]), str(prompts), "--out", str(tmp_path / "out"), "--max-new-tokens", "8",
                 "--temperature", "0", "--draft-tokens", "1", "2"]) == 0
    summary = json.loads((tmp_path / "out" / "report.json").read_text())["summary"]
    assert summary["sampling"]["temperature"] == 0 and summary["all_identical"]
    by_k = summary["by_draft_tokens"]
    assert list(by_k["sampled"]) == list(by_k["greedy"]) == ["1", "2"]
    for k, greedy in by_k["greedy"].items():
        sampled = by_k["sampled"][k]
        assert (sampled["acceptance_rate"], sampled["mean_accepted_length"]) == (
            greedy["acceptance_rate"], greedy["mean_accepted_length"]), k
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "0: greedy verification" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main([str(checkpoints["qwen3"]), str(prompts), "--out", str(tmp_path / "refused"), "--temperature", "-1"])
    assert "--temperature -1.0 must be >= 0 (0: greedy verification)" in capsys.readouterr().err
    for flag, value, message in (("--draft-tokens", "0", "argument --draft-tokens: 0 must be at least 1"),
                                  ("--max-new-tokens", "-2", "argument --max-new-tokens: -2 must be at least 1"),
                                  ("--max-new-tokens", "x", "'x' is not a whole number"),
                                  ("--top-p", "0", "--top-p 0.0 must be in (0, 1]")):
        with pytest.raises(SystemExit):  # at parsing, before any model is loaded
            main([str(tmp_path / "absent"), str(prompts), "--out", str(tmp_path / "refused"), flag, value])
        assert message in capsys.readouterr().err


def test_bad_inputs_name_the_problem(checkpoints, tmp_path):
    rows = tmp_path / "bad.jsonl"
    rows.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each row needs a 'prompt' string or a 'messages' list"):
        read_prompts(rows)
    (tmp_path / "megatron_checkpoint").mkdir()
    with pytest.raises(ValueError, match="no config.json.*export_hf"):
        load_target(tmp_path / "megatron_checkpoint")
    target = load_target(checkpoints["qwen3_no_mtp"])
    with pytest.raises(ValueError, match="has no MTP head.*mtp.fc.weight.*model.mtp_layers.0.input_proj.weight"):
        load_mtp_head(checkpoints["qwen3_no_mtp"], target)


@pytest.mark.parametrize("family", ["qwen3", "mimo"])
def test_a_quiet_report_prints_nothing_while_loading(checkpoints, capfd, family):
    """Without progress, loading the target, its head and the tokenizer writes nothing: not transformers' "layers
    not sharded" nor its per-tensor bar, nor MiMo's "a model of type `mimo`" (none of it asks anything of the user)."""
    capfd.readouterr()
    measure_checkpoint(checkpoints[family], [PROMPTS[0]], max_new_tokens=2, draft_tokens=(1,))
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")

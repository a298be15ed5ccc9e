"""`lightning-megatron`: every config parses and validates, the CPU default fits, predict writes the model's own
greedy continuations (equal to HF's greedy decoding) as SFT rows that train on exactly those ids, the optimizer
group is refused, and the main job raises the MTP head's acceptance."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

import lightning_megatron.callbacks as package_callbacks
from lightning_megatron import DraftProbe, MegatronStrategy, SFTDataModule, SFTModule
from lightning_megatron.cli.megatron_cli import MegatronCLI
from lightning_megatron.cli.vl import VLMegatronCLI
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.vl.data import VLSFTDataModule
from lightning_megatron.vl.module import VLSFTModule
from tests._background import Command, background_runs

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def _env() -> dict[str, str]:
    env = _env_as_a_user()
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _env_as_a_user() -> dict[str, str]:
    """What a user's shell gives: Python's default warning filters (what the default fit's output is checked for)."""
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    env.pop("PYTHONWARNINGS", None)
    return env


# what the libraries print about each other or about what the package handles: nothing a user can act on
# (lightning_megatron/_compat/quiet.py)
NOISE = ("No CUDA runtime is found", "Transformer Engine and Apex are not installed", "Apex is not installed",
         "Only transformer-engine>=1.7.0", "MimoModelConfig is experimental", "full scope is deprecated",
         "GPTModel IS DEPRECATED", "full_param_layout not provided", "gradient_accumulation_fusion requires",
         "not a leaf Tensor", "`torch.distributed.reduce_scatter_tensor` is deprecated",
         "`torch.distributed.all_gather_into_tensor` is deprecated", "LeafSpec", "`torch_dtype` is deprecated",
         "`torch.jit.script` is deprecated", "is not tested with current version of modelopt", "Traceback")


def _write_default_config(folder: Path, device: str) -> None:
    """configs/tiny/mtp_only.yaml, 4 steps, writing under `folder` (the checkpoint made there on first use)."""
    config = yaml.safe_load((ROOT / "configs/tiny/mtp_only.yaml").read_text())
    config["trainer"].update(max_steps=4, val_check_interval=2, default_root_dir=str(folder), accelerator=device)
    config["trainer"]["strategy"]["init_args"]["hf_checkpoint"] = str(folder / "tiny")
    config["trainer"]["strategy"]["init_args"]["precision"] = "fp32" if device == "cpu" else "bf16"
    if device == "gpu":  # the GPU machine has no tensorboard; the CSV logger then holds the curves too
        config["trainer"]["logger"] = config["trainer"]["logger"][1:]
    for logger in config["trainer"]["logger"]:
        logger["init_args"]["save_dir"] = str(folder)
    for callback in config["trainer"]["callbacks"]:
        if "dirpath" in callback.get("init_args", {}):
            callback["init_args"]["dirpath"] = str(folder / Path(callback["init_args"]["dirpath"]).name)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


PREDICT_PROMPTS = [{"prompt": "What is the capital of France?"}, {"prompt": "How do I run the tests?"},
                   {"messages": [{"role": "system", "content": "Answer briefly."},
                                 {"role": "user", "content": "Write a function that adds two numbers."}]}]


def _predict_inputs(folder: Path) -> None:
    make_tiny_checkpoint(folder / "tiny", "qwen3", mtp=True)
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PREDICT_PROMPTS))


def _command(test: str, args, env=_env, **options) -> Command:
    return Command(test, args, env, ROOT, **options)


# the main job runs about a minute, mostly on one core: started when the session starts (tests/_background.py)
EARLY_RUNS = {"main_job": _command("test_main_job_raises_acceptance_on_held_out_prompts", lambda folder: [
    "lightning_megatron.cli.quickstart", "--workdir", str(folder / "work"), "--max-steps", "60"], timeout=600)}
# the other processes the tests below read, started when the module starts, in the order the tests read them
CLI_RUNS = {
    "print_config": _command("test_print_config_shows_the_strategy_and_the_model_options", lambda folder: [
        "lightning_megatron.cli", "fit", "--config", "configs/tiny/mtp_only.yaml", "--print_config"]),
    "optimizer": _command("test_optimizer_group_is_refused_with_where_to_configure_it", lambda folder: [
        "lightning_megatron.cli", "fit", "--config", "configs/tiny/mtp_only.yaml", "--make_tiny_checkpoint", "false",
        "--optimizer", "torch.optim.AdamW", "--trainer.strategy.init_args.hf_checkpoint", str(folder / "empty")],
        prepare=lambda folder: (folder / "empty").mkdir()),
    **{f"default_fit[{device}]": _command(
        f"test_default_config_fits_and_writes_logs_checkpoint_plot_audit_and_export[{device}]",
        lambda folder: ["lightning_megatron.cli", "fit", "--config", str(folder / "config.yaml")], _env_as_a_user,
        prepare=lambda folder, device=device: _write_default_config(folder, device)) for device in ("cpu", "gpu")},
    "predict": _command("test_predict_writes_hf_greedy_continuations_that_train_on_exactly_those_ids", lambda folder: [
        "lightning_megatron.cli", "predict", "--config", "configs/tiny/generate.yaml",
        "--trainer.strategy.init_args.hf_checkpoint", str(folder / "tiny"), "--trainer.default_root_dir", str(folder),
        "--data.predict_path", str(folder / "prompts.jsonl"), "--trainer.strategy.init_args.micro_batch_size", "2",
        "--model.max_new_tokens", "20", "--trainer.callbacks", json.dumps(
            [{"class_path": "lightning_megatron.callbacks.ContinuationWriter",
              "init_args": {"output_path": str(folder / "continuations.jsonl")}}])], prepare=_predict_inputs),
}


@pytest.fixture(scope="module", autouse=True)
def cli_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    yield from background_runs(request, tmp_path_factory, CLI_RUNS)


class _ParseAndInstantiate(MegatronCLI):
    """Everything `lightning-megatron` does before it builds the Trainer: parse, check, instantiate every class
    (strategy, callbacks, loggers, module, datamodule). GPU configs cannot build a GPU Trainer here."""

    def instantiate_trainer(self, **kwargs):
        return None


class _ParseAndInstantiateVL(VLMegatronCLI):
    """The same for `lightning-megatron-vl` (the configs named vl_*.yaml)."""

    def instantiate_trainer(self, **kwargs):
        return None


@pytest.mark.parametrize("config", CONFIGS, ids=[str(path.relative_to(ROOT / "configs")) for path in CONFIGS])
def test_every_config_parses_and_instantiates(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_megatron.callbacks import MTPOnlyCallback
    from lightning_megatron.strategy import MegatronStrategy

    monkeypatch.chdir(ROOT)
    cli_class = _ParseAndInstantiateVL if config.name.startswith("vl_") else _ParseAndInstantiate
    cli = cli_class(args=["--config", str(config), "--make_tiny_checkpoint", "false"], run=False)
    strategy = cli.config_init.trainer.strategy
    assert isinstance(strategy, MegatronStrategy)
    callbacks = cli.config_init.trainer.callbacks or []
    if any(isinstance(callback, MTPOnlyCallback) for callback in callbacks):
        assert strategy.bridge_type == "megatron-bridge" and cli.model.enable_mtp_training
    for path in (cli.datamodule.train_path, cli.datamodule.val_path, cli.datamodule.predict_path):
        if path is not None and path.startswith("configs/"):
            assert (ROOT / path).is_file(), f"{config}: {path} is not in the repository"


def test_optimizer_group_is_refused_with_where_to_configure_it(cli_runs) -> None:
    completed, _ = cli_runs.result("optimizer")
    assert completed.returncode == 2  # jsonargparse's status for a bad option (cli/user_errors.py)
    assert "error: optimizer: not used with MegatronStrategy" in completed.stderr
    assert "model.lr" in completed.stderr
    assert "Traceback" not in completed.stderr


# every class whose options `lightning-megatron` and `lightning-megatron-vl` show: strategy, modules, data, callbacks
CLI_CLASSES = [MegatronStrategy, SFTModule, SFTDataModule, VLSFTModule, VLSFTDataModule, DraftProbe,
               *(getattr(package_callbacks, name) for name in package_callbacks.__all__)]


@pytest.mark.parametrize("cls", CLI_CLASSES, ids=[cls.__name__ for cls in CLI_CLASSES])
def test_every_option_has_the_help_its_docstring_gives(cls) -> None:
    """`--help` shows each option's `Args:` entry; the options written as free paragraphs showed no help at all
    (a subclass's inherited options take its base class's entries)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(cls, "options")
    helps = {action.dest.removeprefix("options."): action.help for action in parser._actions}
    undocumented = [name for name in inspect.signature(cls).parameters if not helps.get(name)]
    assert not undocumented, f"{cls.__name__}: no --help text for {undocumented}"
    if cls is MegatronStrategy:
        assert helps["cuda_graph"].startswith("training steps replayed from one captured CUDA graph")


def test_the_export_subcommand_has_the_help_its_docstring_gives() -> None:
    """`lightning-megatron export --help` shows each of the subcommand's own options (`MegatronTrainer.export`)."""
    from jsonargparse import ArgumentParser

    from lightning_megatron.cli.megatron_cli import MegatronTrainer

    parser = ArgumentParser()
    parser.add_method_arguments(MegatronTrainer, "export", skip={"model", "datamodule"})
    helps = {action.dest: action.help for action in parser._actions}
    assert all(helps.get(name) for name in ("ckpt_path", "output", "lora")), helps


def test_print_config_shows_the_strategy_and_the_model_options(cli_runs) -> None:
    completed, _ = cli_runs.result("print_config")
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = yaml.safe_load(completed.stdout)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_megatron.MegatronStrategy"
    assert printed["trainer"]["strategy"]["init_args"]["bridge_type"] == "megatron-bridge"
    assert printed["model"]["enable_mtp"] is True and printed["make_tiny_checkpoint"] is True


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_default_config_fits_and_writes_logs_checkpoint_plot_audit_and_export(cli_runs, device: str) -> None:
    completed, folder = cli_runs.result(f"default_fit[{device}]")
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = completed.stdout + completed.stderr
    assert [noise for noise in NOISE if noise in output] == []
    assert "tokenized rows" in output and "`Trainer.fit` stopped: `max_steps=4` reached." in output
    assert (folder / "tiny" / "config.json").is_file()  # made on first use
    metrics = (folder / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    for name in ("lm_loss", "mtp_loss", "mtp_accuracy", "grad_norm_mtp", "tokens_per_s", "val_lm_loss",
                 "val_mtp_acceptance"):
        assert name in header
    log_dir = folder / ("tensorboard" if device == "cpu" else "csv") / "version_0"
    if device == "cpu":
        assert list(log_dir.glob("events.out.tfevents.*"))
    curves = json.loads((log_dir / "curves.json").read_text())
    assert [step for step, _ in curves["lm_loss"]] == [1, 2, 3, 4]
    assert len(curves["val_mtp_acceptance"]) == len(curves["val_mtp_sampled_acceptance"]) == 2
    assert (log_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((folder / "mtp_only_audit.json").read_text())["frozen_bit_identical"]
    assert (folder / "checkpoints" / "last.ckpt" / "COMPLETE").is_file()
    assert (folder / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_predict_writes_hf_greedy_continuations_that_train_on_exactly_those_ids(cli_runs) -> None:
    from transformers import AutoTokenizer

    from lightning_megatron.data import SFTDataModule
    from lightning_megatron.speculative import greedy_decode, load_target
    from lightning_megatron.speculative.report import encode_prompt, eos_token_ids

    completed, folder = cli_runs.result("predict")
    checkpoint, prompts, output = folder / "tiny", PREDICT_PROMPTS, folder / "continuations.jsonl"
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == len(prompts)

    target = load_target(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    eos = eos_token_ids(checkpoint, tokenizer)
    for prompt, row in zip(prompts, rows):
        prompt_ids = encode_prompt(tokenizer, prompt.get("prompt") or prompt["messages"])
        assert row["response_token_ids"] == greedy_decode(target, prompt_ids, 20, eos).tokens
        assert row["finish_reason"] == ("eos" if row["response_token_ids"][-1] in eos else "length")
        if "messages" in prompt:
            assert row["messages"][:-1] == prompt["messages"] and row["messages"][-1]["role"] == "assistant"
        else:
            assert row["prompt"] == prompt["prompt"] and row["response"] == tokenizer.decode(row["response_token_ids"])

    # training on the rows sees the prompt and exactly the generated ids, the loss on the generated ones
    datamodule = SFTDataModule(str(output), hf_checkpoint=str(checkpoint), seq_length=128, micro_batch_size=1)
    datamodule.setup("fit")
    for index, (prompt, row) in enumerate(zip(prompts, rows)):
        sample = datamodule.datasets["train"][index]
        prompt_ids = encode_prompt(tokenizer, prompt.get("prompt") or prompt["messages"])
        expected = prompt_ids + row["response_token_ids"]
        assert sample["input_ids"][: len(expected)].tolist() == expected
        trained_labels = sample["labels"][sample["loss_mask"].bool()].tolist()
        assert trained_labels == row["response_token_ids"]


@pytest.mark.slow
def test_validation_acceptance_equals_the_hf_reference(tmp_path: Path) -> None:
    """`val_mtp_acceptance` through the strategy = the metric on HF's own main and MTP logits for the same rows."""
    import lightning.pytorch as pl

    from lightning_megatron import MegatronStrategy, SFTDataModule, SFTModule
    from lightning_megatron.mtp.acceptance import MTPAcceptanceAccuracy
    from lightning_megatron.speculative import load_target
    from lightning_megatron.testing.references import hf_mtp_reference_logits

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "qwen3", mtp=True)
    rows = [{"prompt": "What is the capital of France?", "response": "The capital of France is Paris."},
            {"prompt": "How do I run the tests?", "response": "Install the package, then run pytest."}]
    data_file = tmp_path / "val.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", precision="fp32",
                                micro_batch_size=1, global_batch_size=1)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    datamodule = SFTDataModule(val_path=str(data_file), seq_length=64)
    logged = trainer.validate(SFTModule(enable_mtp=True), datamodule=datamodule, verbose=False)[0]

    target = load_target(checkpoint)
    reference = MTPAcceptanceAccuracy()
    for sample in datamodule.datasets["val"]:
        ids = sample["input_ids"].unsqueeze(0)
        with torch.no_grad():
            main = target(input_ids=ids).logits
        reference.update(hf_mtp_reference_logits(checkpoint, ids), main, sample["loss_mask"].unsqueeze(0))
    assert reference.counted > 0
    assert logged["val_mtp_acceptance"] == pytest.approx(float(reference.compute()))


@pytest.mark.slow
def test_main_job_raises_acceptance_on_held_out_prompts(early_runs) -> None:
    """README command 1, shortened: continuations, MTP-only fit, acceptance before < after, identical outputs."""
    completed, folder = early_runs.result("main_job")
    work = folder / "work"
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    before = json.loads((work / "acceptance_before" / "report.json").read_text())["summary"]
    after = json.loads((work / "acceptance_after" / "report.json").read_text())["summary"]
    assert before["acceptance_rate"] < 0.05 < after["acceptance_rate"]
    assert before["all_identical"] and after["all_identical"]
    assert "MTP draft acceptance on held-out prompts: before" in completed.stdout
    assert (work / "mtp_only" / "checkpoints" / "last.ckpt" / "COMPLETE").is_file()


@pytest.mark.slow
def test_quickstart_notebook_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell of notebooks/quickstart.ipynb runs in a fresh kernel (no launcher, fit in-process)."""
    import nbformat
    from nbclient import NotebookClient

    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the kernel picks its own rendezvous port
        monkeypatch.delenv(name, raising=False)
    notebook = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("image/png" in output.get("data", {}) for output in outputs)

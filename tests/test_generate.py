"""`predict`'s decoding (lightning_megatron/generate.py): samples of softmax(logits / T) over a vocabulary split
across tensor-parallel ranks, and sampled continuations whose rows depend on their own seeds alone.

The greedy path is checked end to end against HF's greedy decoding (tests/cli/test_megatron_cli.py, `predict`)."""

import json
from pathlib import Path

import pytest
import torch

from tests._distributed import run_distributed

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _generators(seeds: range) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_a_sample_is_drawn_from_the_softmax_at_the_temperature(model_parallel, temperature: float) -> None:
    """6,000 rows, a generator each: every id's count is within 5 standard deviations of its binomial mean (the
    seeds are fixed, so the counts are the same on any machine). Ignoring the temperature moves the first id's count
    by 1,500 or more, 40 standard deviations."""
    from lightning_megatron.generate import vocab_parallel_sample

    draws = 6000
    ids = vocab_parallel_sample(LOGITS.expand(draws, -1), temperature, _generators(range(draws)))
    counts = torch.bincount(ids, minlength=len(LOGITS)).double()
    expected = torch.softmax(LOGITS.double() / temperature, -1) * draws
    deviation = (expected * (1 - expected / draws)).sqrt()
    assert ((counts - expected).abs() <= 5 * deviation + 1).all(), (counts, expected)


def test_sampling_refuses_a_temperature_of_zero_and_a_generator_count_other_than_the_rows(model_parallel) -> None:
    from lightning_megatron.generate import continuations, vocab_parallel_sample

    with pytest.raises(ValueError, match="temperature: 0.0 must be > 0"):
        vocab_parallel_sample(LOGITS.expand(2, -1), 0.0, _generators(range(2)))
    with pytest.raises(ValueError, match="1 generators for 2 rows"):
        vocab_parallel_sample(LOGITS.expand(2, -1), 1.0, _generators(range(1)))
    with pytest.raises(ValueError, match="needs one seed per row"):
        continuations(torch.nn.Identity(), torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 3]), 4, {0},
                      temperature=1.0)


def _tensor_parallel_samples(rank: int, world_size: int) -> torch.Tensor:
    from megatron.core import parallel_state

    from lightning_megatron._compat import prepare_megatron_core
    from lightning_megatron.generate import vocab_parallel_sample

    prepare_megatron_core()
    parallel_state.initialize_model_parallel(world_size, 1)
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    half = logits.shape[-1] // world_size
    return vocab_parallel_sample(logits[:, rank * half:(rank + 1) * half], 0.7, _generators(range(64)))


@pytest.mark.slow
def test_at_tensor_parallel_two_each_row_draws_the_id_one_process_draws(model_parallel, tmp_path) -> None:
    """Each rank holds half of the vocabulary and draws the whole vocabulary's noise: the ids equal the one-process
    draws from the same seeds (which the argmax of a rank's own noise alone would not)."""
    from lightning_megatron.generate import vocab_parallel_sample

    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    expected = vocab_parallel_sample(logits, 0.7, _generators(range(64)))
    assert len(set(expected.tolist())) > 3  # the rows' draws differ: the comparison below has something to catch
    for rank, ids in enumerate(run_distributed(_tensor_parallel_samples, tmp_path)):
        assert torch.equal(ids, expected), rank


def _reference_continuation(model: torch.nn.Module, prompt: list[int], new_tokens: int, temperature: float,
                            seed: int, eos: int) -> list[int]:
    """One row on its own, unpadded, one whole forward per token, each token the Gumbel-max draw of the last
    position's logits with the row's generator."""
    generator, tokens, answer = torch.Generator().manual_seed(seed), list(prompt), []
    for _ in range(new_tokens):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=torch.arange(len(tokens)).unsqueeze(0), attention_mask=None)
        noise = torch.empty(logits.shape[-1]).exponential_(generator=generator)
        token = int((logits[0, -1].float() / temperature - noise.log()).argmax())
        answer.append(token)
        tokens.append(token)
        if token == eos:
            break
    return answer


def test_sampled_continuations_of_a_padded_batch_equal_each_row_decoded_alone(model_parallel) -> None:
    """Rows of different prompt lengths (right-padded), a seed each, one of them stopping at its end-of-sequence
    id: each row's continuation equals its own unbatched decoding from its seed, and other seeds give others."""
    from lightning_megatron.generate import continuations
    from tests._megatron import VOCAB, tiny_gpt

    model = tiny_gpt(mtp_layers=0).eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in (5, 9, 2)]
    seeds, new_tokens, temperature = [11, 12, 13], 8, 1.0
    eos = _reference_continuation(model, prompts[1], 3, temperature, seeds[1], eos=-1)[-1]  # row 1 stops there
    references = [_reference_continuation(model, prompt, new_tokens, temperature, seed, eos)
                  for prompt, seed in zip(prompts, seeds)]
    assert len(references[1]) <= 3 < len(references[0])

    input_ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, :len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    assert continuations(model, input_ids, lengths, new_tokens, {eos}, temperature=temperature,
                         row_seeds=seeds) == references
    others = continuations(model, input_ids, lengths, new_tokens, {eos}, temperature=temperature,
                           row_seeds=[seed + 100 for seed in seeds])
    assert others != references


@pytest.mark.parametrize(("option", "message"), [
    ({"generation_temperature": -0.5}, r"generation_temperature: -0.5 must be finite and >= 0 \(0: greedy"),
    ({"generation_temperature": float("nan")}, r"generation_temperature: nan must be finite and >= 0"),
    ({"generation_seed": -1}, r"generation_seed: -1 must be in \[0, 2\*\*31\)"),
])
def test_the_module_refuses_a_bad_generation_option_naming_it(option: dict, message: str) -> None:
    from lightning_megatron import SFTModule

    with pytest.raises(ValueError, match=message):
        SFTModule(**option)


def _predicted(tmp_path: Path, checkpoint: Path, prompts: Path, name: str, micro_batch_size: int,
               **module: float) -> list[list[int]]:
    import lightning.pytorch as pl

    from lightning_megatron import MegatronStrategy, SFTDataModule, SFTModule
    from lightning_megatron.callbacks import ContinuationWriter

    output = tmp_path / f"{name}.jsonl"
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(checkpoint), precision="fp32",
                                                   micro_batch_size=micro_batch_size),
                         accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ContinuationWriter(str(output))])
    trainer.predict(SFTModule(max_new_tokens=12, **module),
                    datamodule=SFTDataModule(predict_path=str(prompts), seq_length=64))
    return [json.loads(line)["response_token_ids"] for line in output.read_text().splitlines()]


@pytest.mark.slow
def test_predict_samples_each_prompt_from_its_own_seed_at_any_micro_batch_size(tmp_path: Path) -> None:
    """`predict` with `generation_temperature: 1.0` through the Trainer: one prompt at a time and three at a time
    write the same rows; another `generation_seed` and greedy decoding write others."""
    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "qwen3", mtp=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {index}: what comes next?"}) + "\n"
                               for index in range(5)))
    one_at_a_time = _predicted(tmp_path, checkpoint, prompts, "one", 1, generation_temperature=1.0,
                               generation_seed=7)
    assert len(one_at_a_time) == 5
    assert _predicted(tmp_path, checkpoint, prompts, "three", 3, generation_temperature=1.0,
                      generation_seed=7) == one_at_a_time
    assert _predicted(tmp_path, checkpoint, prompts, "seed", 3, generation_temperature=1.0,
                      generation_seed=8) != one_at_a_time
    assert _predicted(tmp_path, checkpoint, prompts, "greedy", 3) != one_at_a_time

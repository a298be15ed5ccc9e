"""SFT data: response-only masks from the real tokenizer, padding and packing, and malformed or overlong rows
stopping the run in setup (the context-parallel split of a microbatch is in tests/test_microbatch.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from transformers import AutoTokenizer

from lightning_megatron.data import (
    DataValidationError,
    SFTDataModule,
    TokenizedExample,
    first_fit,
    read_jsonl,
    tokenize_example,
    tokenize_examples,
)
from lightning_megatron.data.packing import pack_examples, pad_example
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.tokenizer import CHAT_TEMPLATE

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "Sure."},
]
PROMPT_RESPONSE = {"prompt": "Can you write a function that adds two numbers?", "response": "Here is a short one."}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("data") / "qwen3")


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Any:
    return AutoTokenizer.from_pretrained(checkpoint)


def _tokenizer_with_template(checkpoint: Path, template: str | None) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = template
    return tokenizer


def write_jsonl(path: Path, rows: list[Any]) -> str:
    """Rows as dicts (dumped) or raw strings (written as they are, for malformed lines)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def trained_text(tokenizer: Any, labels: torch.Tensor, loss_mask: torch.Tensor) -> list[str]:
    """The label tokens with loss_mask 1, decoded run by run (one string per stretch of consecutive ones)."""
    runs, current = [], []
    for label, weight in zip(labels.tolist(), loss_mask.tolist()):
        if weight:
            current.append(label)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def _example(source: str, ids: list[int], mask: list[int]) -> TokenizedExample:
    return TokenizedExample(source, torch.tensor(ids), torch.tensor(mask, dtype=torch.bool))


# --- masks ---------------------------------------------------------------------------------------------------------


def test_messages_row_trains_on_every_assistant_turn_and_its_end_token(tmp_path: Path, tokenizer: Any) -> None:
    (example,) = read_jsonl(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    tokenized = tokenize_example(example, tokenizer)
    sample = pad_example(tokenized, 96, tokenizer.pad_token_id)

    assert trained_text(tokenizer, sample["labels"], sample["loss_mask"]) == [
        "The capital of France is Paris.<|im_end|>",
        "Sure.<|im_end|>",
    ]
    assert tokenizer.decode(sample["input_ids"][: len(tokenized)]) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_prompt_response_row_is_a_user_and_an_assistant_turn_with_a_chat_template(
    tmp_path: Path, tokenizer: Any
) -> None:
    (example,) = read_jsonl(write_jsonl(tmp_path / "pr.jsonl", [PROMPT_RESPONSE]))
    tokenized = tokenize_example(example, tokenizer)
    sample = pad_example(tokenized, 64, tokenizer.pad_token_id)

    assert trained_text(tokenizer, sample["labels"], sample["loss_mask"]) == ["Here is a short one.<|im_end|>"]
    expected = [{"role": "user", "content": PROMPT_RESPONSE["prompt"]},
                {"role": "assistant", "content": PROMPT_RESPONSE["response"]}]
    assert tokenizer.decode(tokenized.input_ids) == tokenizer.apply_chat_template(expected, tokenize=False)


def test_a_prompt_completion_row_trl_style_is_a_prompt_response_row(tmp_path: Path) -> None:
    completion = {"prompt": PROMPT_RESPONSE["prompt"], "completion": PROMPT_RESPONSE["response"]}
    (ours,) = read_jsonl(write_jsonl(tmp_path / "pr.jsonl", [PROMPT_RESPONSE]))
    (trl,) = read_jsonl(write_jsonl(tmp_path / "pc.jsonl", [completion]))
    assert (trl.prompt, trl.response, trl.messages) == (ours.prompt, ours.response, ours.messages)


def test_prompt_response_row_without_a_chat_template_is_prompt_response_eos(tmp_path: Path, checkpoint: Path) -> None:
    plain = _tokenizer_with_template(checkpoint, None)
    (example,) = read_jsonl(write_jsonl(tmp_path / "pr.jsonl", [PROMPT_RESPONSE]))
    tokenized = tokenize_example(example, plain)
    sample = pad_example(tokenized, 64, plain.pad_token_id)

    prompt_ids = plain(PROMPT_RESPONSE["prompt"])["input_ids"]
    response_ids = plain(PROMPT_RESPONSE["response"], add_special_tokens=False)["input_ids"]
    assert tokenized.input_ids.tolist() == prompt_ids + response_ids + [plain.eos_token_id]
    assert trained_text(plain, sample["labels"], sample["loss_mask"]) == [
        PROMPT_RESPONSE["response"] + plain.eos_token
    ]


def test_messages_row_without_a_chat_template_is_reported(tmp_path: Path, checkpoint: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [PROMPT_RESPONSE, {"messages": CONVERSATION}])
    with pytest.raises(DataValidationError, match=rf"{path}:2: .*no chat template"):
        tokenize_examples(read_jsonl(path), _tokenizer_with_template(checkpoint, None), max_tokens=128)


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"], ids=["chat_eos", "base_model_eos"])
def test_mask_from_prefix_renders_equals_the_generation_block_mask(tmp_path: Path, checkpoint: Path,
                                                                   tokenizer: Any, eos: str) -> None:
    """A base model's tokenizer ends text with <|endoftext|>, its template's turns with <|im_end|>: the newline
    after it is not trained on either."""
    without_block = CHAT_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert without_block != CHAT_TEMPLATE and "endgeneration" not in without_block
    fallback = _tokenizer_with_template(checkpoint, without_block)
    fallback.eos_token = eos
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}, PROMPT_RESPONSE]
    for example in read_jsonl(write_jsonl(tmp_path / "rows.jsonl", rows)):
        expected, got = tokenize_example(example, tokenizer), tokenize_example(example, fallback)
        assert torch.equal(got.input_ids, expected.input_ids)
        assert torch.equal(got.response_mask, expected.response_mask), example.source


TOOL_CALL_TEMPLATE = CHAT_TEMPLATE.replace(  # Qwen's way: the calls rendered inside the assistant turn
    "{{- message['content'] + '<|im_end|>' }}",
    "{{- message['content'] }}{%- for call in message.tool_calls or [] %}<call>{{ call.function.name }}"
    "({{ call.function.arguments }})</call>{%- endfor %}{{- '<|im_end|>' }}")


@pytest.mark.parametrize("generation_block", [True, False], ids=["generation_block", "prefix_renders"])
def test_an_assistant_turn_that_calls_tools_trains_on_its_calls(tmp_path: Path, checkpoint: Path,
                                                                generation_block: bool) -> None:
    """OpenAI's tool-calling form: the call in 'tool_calls', content null; the template renders the call."""
    assert TOOL_CALL_TEMPLATE != CHAT_TEMPLATE
    template = TOOL_CALL_TEMPLATE if generation_block else TOOL_CALL_TEMPLATE.replace(
        "{%- generation %}", "").replace("{%- endgeneration %}", "")
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    conversation = [{"role": "user", "content": "What is 2+2?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "4", "tool_call_id": "c1"},
                    {"role": "assistant", "content": "It is 4."}]
    (example,) = read_jsonl(write_jsonl(tmp_path / "tools.jsonl", [{"messages": conversation}]))
    tokenizer = _tokenizer_with_template(checkpoint, template)
    tokenized = tokenize_example(example, tokenizer)
    sample = pad_example(tokenized, 96, tokenizer.pad_token_id)
    assert trained_text(tokenizer, sample["labels"], sample["loss_mask"]) == [
        '<call>add({"a": 2})</call><|im_end|>', "It is 4.<|im_end|>"]


def test_a_conversation_the_chat_template_refuses_is_named_by_its_line(tmp_path: Path, checkpoint: Path) -> None:
    """Gemma's and Mistral's templates raise_exception on a system turn or roles out of turn."""
    refusing = _tokenizer_with_template(checkpoint, "{%- if messages[0]['role'] == 'system' %}"
                                                    "{{ raise_exception('System role not supported') }}{%- endif %}"
                                        + CHAT_TEMPLATE)
    path = write_jsonl(tmp_path / "chat.jsonl", [PROMPT_RESPONSE, {"messages": CONVERSATION}])
    with pytest.raises(DataValidationError, match=rf"1 of 2 rows are malformed:\n  {path}:2: the chat template "
                                                  r"refuses this conversation \(TemplateError: System role not "
                                                  r"supported\)"):
        tokenize_examples(read_jsonl(path), refusing, max_tokens=128)


def test_a_dict_of_named_chat_templates_renders_with_its_default(tmp_path: Path, checkpoint: Path,
                                                                 tokenizer: Any) -> None:
    """transformers keeps several templates as a dict (chat_template.jinja + additional_chat_templates/)."""
    named = _tokenizer_with_template(checkpoint, {"default": CHAT_TEMPLATE, "tool_use": TOOL_CALL_TEMPLATE})
    (example,) = read_jsonl(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    expected, got = tokenize_example(example, tokenizer), tokenize_example(example, named)
    assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.response_mask, expected.response_mask)


# --- padding and packing -------------------------------------------------------------------------------------------


def test_padded_micro_batches(tmp_path: Path, checkpoint: Path, tokenizer: Any) -> None:
    rows = [{"prompt": f"Question {i}?", "response": f"Answer {i}."} for i in range(7)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    datamodule = SFTDataModule(train, hf_checkpoint=str(checkpoint), seq_length=48, micro_batch_size=2, seed=3)
    datamodule.setup("fit")
    batches = list(datamodule.train_dataloader())

    assert len(batches) == 3  # 7 rows, micro batches of 2, the last partial one dropped
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "loss_mask", "position_ids"}
        assert batch["input_ids"].shape == (2, 48) and batch["input_ids"].dtype == torch.int64
        assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
        assert batch["loss_mask"].dtype == torch.float32
        assert torch.equal(batch["position_ids"], torch.arange(48).expand(2, 48))
        for row in range(2):
            ids, labels, mask = batch["input_ids"][row], batch["labels"][row], batch["loss_mask"][row]
            length = int((ids != tokenizer.pad_token_id).sum())
            assert (ids[length:] == tokenizer.pad_token_id).all()  # padding only at the right end
            assert torch.equal(labels[: length - 1], ids[1:length])
            assert mask[length - 1 :].sum() == 0  # the last token and the pads are never trained on
            assert trained_text(tokenizer, labels, mask)[0] in {row["response"] + "<|im_end|>" for row in rows}

    again = SFTDataModule(train, hf_checkpoint=str(checkpoint), seq_length=48, micro_batch_size=2, seed=3)
    again.setup("fit")
    other_seed = SFTDataModule(train, hf_checkpoint=str(checkpoint), seq_length=48, micro_batch_size=2, seed=4)
    other_seed.setup("fit")
    order = [batch["input_ids"] for batch in batches]
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(order, again.train_dataloader()))
    assert not all(torch.equal(a, b["input_ids"]) for a, b in zip(order, other_seed.train_dataloader()))


def test_first_fit_fills_the_first_bin_with_room_in_file_order() -> None:
    assert first_fit([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    assert first_fit([6, 5, 2, 3], 8) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit([9], 8)


@pytest.mark.parametrize("alignment", [1, 4])
def test_packed_row_restarts_positions_and_no_label_crosses_a_sequence(alignment: int) -> None:
    examples = [
        _example("a:1", [10, 11, 12, 13, 14], [0, 0, 1, 1, 1]),
        _example("a:2", [20, 21, 22, 23, 24, 25, 26], [0, 1, 1, 0, 1, 1, 1]),
        _example("a:3", [30, 31, 32], [0, 1, 1]),
    ]
    pad_id = 0
    sample = pack_examples(examples, 24, pad_id, alignment)
    spans = {1: [5, 7, 3], 4: [8, 8, 4]}[alignment]
    starts = [0, spans[0], spans[0] + spans[1]]
    used = sum(spans)
    assert sample["cu_seqlens"].tolist() == [0, *(s + n for s, n in zip(starts, spans)), 24]
    assert sample["cu_seqlens"].dtype == torch.int32
    assert int(sample["max_seqlen"]) == max(*spans, 24 - used)

    expected_positions = torch.cat([torch.arange(n) for n in [*spans, 24 - used]])
    assert torch.equal(sample["position_ids"], expected_positions)
    for example, start in zip(examples, starts):
        n = len(example)
        assert sample["input_ids"][start : start + n].tolist() == example.input_ids.tolist()
        assert sample["labels"][start : start + n - 1].tolist() == example.input_ids[1:].tolist()
        assert sample["loss_mask"][start : start + n].tolist() == [*example.response_mask[1:].float().tolist(), 0.0]
    trained = sample["loss_mask"].nonzero().flatten().tolist()
    segment_of = torch.bucketize(torch.arange(24), sample["cu_seqlens"][1:].long(), right=True)
    for t in trained:  # the label of t is token t + 1 of the same sequence
        assert segment_of[t] == segment_of[t + 1] and sample["labels"][t] == sample["input_ids"][t + 1]
    assert sample["loss_mask"].sum() == sum(example.trainable_tokens for example in examples)


def test_packed_datamodule_aligns_each_sequence_for_context_parallelism(tmp_path: Path, checkpoint: Path,
                                                                        tokenizer: Any) -> None:
    rows = [{"prompt": f"Question {i}?", "response": "Yes. " * (1 + i % 3)} for i in range(9)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    datamodule = SFTDataModule(
        train, hf_checkpoint=str(checkpoint), seq_length=64, packing=True, micro_batch_size=1,
        context_parallel_size=2,
    )
    datamodule.setup("fit")
    dataset = datamodule.datasets["train"]
    assert sorted(i for members in dataset.bins for i in members) == list(range(9))  # every row, once

    seen = []
    for batch in datamodule.train_dataloader():
        assert batch["input_ids"].shape == (1, 64) and batch["cu_seqlens"].ndim == 1
        cu_seqlens = batch["cu_seqlens"].tolist()
        assert cu_seqlens[0] == 0 and cu_seqlens[-1] == 64
        assert all((end - start) % 4 == 0 for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            assert batch["position_ids"][0, start:end].tolist() == list(range(end - start))
            seen += trained_text(tokenizer, batch["labels"][0, start:end], batch["loss_mask"][0, start:end])
    assert sorted(seen) == sorted(row["response"] + "<|im_end|>" for row in rows)


# --- malformed and overlong rows -----------------------------------------------------------------------------------

GOOD = {"prompt": "Hi", "response": "Hello."}


def good_file(tmp_path: Path) -> str:
    return write_jsonl(tmp_path / "good.jsonl", [GOOD])


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "Hi", "response": ', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got a list"),
        ('{"text": "Hi"}', "missing key 'messages' or 'prompt'"),
        ('{"prompt": "Hi"}', "missing key 'response'"),
        ('{"prompt": 3, "response": "x"}', "'prompt' must be a string, got a number"),
        ('{"prompt": "Hi", "response": "  "}', "'response' is empty"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role 'bot' is unknown"),
        ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content must be a string"),
        ('{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]}',
         "image + text rows are read by VLSFTDataModule; run `lightning-megatron-vl fit`"),
        ('{"messages": [{"role": "user"}]}', "messages[0] is missing key 'content'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}', "empty content"),
        ('{"messages": [], "prompt": "x"}', "has both"),
        ('{"prompt": "Hi", "response": "a", "completion": "b"}', "has both 'response' and 'completion'"),
        ('{"prompt": "Hi", "completion": 7}', "'completion' must be a string, got a number"),
    ],
)
def test_a_malformed_row_stops_setup_with_its_line_number(
    tmp_path: Path, checkpoint: Path, line: str, problem: str
) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [GOOD, "", line, GOOD])  # the bad row is on line 3
    datamodule = SFTDataModule(train, hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1)
    with pytest.raises(DataValidationError) as error:
        datamodule.setup("fit")
    message = str(error.value)
    assert f"{train}:3: " in message and problem in message
    assert "1 of 3 rows are malformed" in message and "A valid row is" in message
    assert "train" not in datamodule.datasets


@pytest.mark.parametrize("stage", [TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING])
def test_a_stage_without_its_file_names_the_field_to_set(tmp_path: Path, checkpoint: Path, stage: TrainerFn) -> None:
    datamodule = SFTDataModule(good_file(tmp_path), hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1)
    split = {"validate": "val", "test": "test", "predict": "predict"}[stage.value]
    with pytest.raises(ValueError, match=rf"^{split}_path is not set, but trainer.{stage.value}\(\) needs it: set "
                                         rf"data.{split}_path \(SFTDataModule\({split}_path=...\)\)$"):
        datamodule.setup(stage)


def test_malformed_rows_are_listed_first_few_with_a_count(tmp_path: Path, checkpoint: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [GOOD] + ["{"] * 7)
    val = write_jsonl(tmp_path / "val.jsonl", [GOOD, {"prompt": "Hi", "response": 1}])
    with pytest.raises(DataValidationError) as error:
        SFTDataModule(train, hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1).setup("fit")
    message = str(error.value)
    assert "7 of 8 rows" in message and f"{train}:6:" in message and f"{train}:7:" not in message
    assert "... and 2 more" in message
    with pytest.raises(DataValidationError, match=rf"{val}:2: 'response' must be a string"):
        SFTDataModule(good_file(tmp_path), val, hf_checkpoint=str(checkpoint), seq_length=32,
                      micro_batch_size=1).setup("validate")


def GOOD_PATH(tmp_path: Path) -> str:
    return write_jsonl(tmp_path / "good.jsonl", [GOOD])


def test_a_row_that_is_not_utf8_is_reported_by_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"prompt": "caf\u00e9", "response": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataValidationError, match=rf"{path}:2: not valid UTF-8"):
        read_jsonl(path)


def test_overlong_rows_truncate_drop_or_error(tmp_path: Path, checkpoint: Path, tokenizer: Any) -> None:
    long_answer = {"prompt": "Hi", "response": "The quick brown fox jumps over the lazy dog. " * 4}
    long_prompt = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "response": "Yes."}
    rows = [GOOD, long_answer, long_prompt]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    examples = read_jsonl(path)
    full = tokenize_example(examples[1], tokenizer)
    seq_length = 24
    assert len(full) > seq_length > len(tokenize_example(examples[0], tokenizer))

    kept, dropped = tokenize_examples(examples[:2], tokenizer, max_tokens=seq_length)
    assert dropped == 0 and torch.equal(kept[1].input_ids, full.input_ids[:seq_length])  # the start is kept
    assert torch.equal(kept[1].response_mask, full.response_mask[:seq_length])

    with pytest.raises(DataValidationError, match=rf"{path}:3: no response token left to train on after truncating"):
        tokenize_examples(examples, tokenizer, max_tokens=seq_length)
    with pytest.raises(DataValidationError, match=rf"{path}:2: has {len(full)} tokens.*overlong='error'"):
        tokenize_examples(examples, tokenizer, max_tokens=seq_length, overlong="error")

    datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=seq_length, micro_batch_size=1,
                               overlong="drop")
    with pytest.warns(UserWarning, match="dropped 2 of 3 rows"):
        datamodule.setup("fit")
    assert len(datamodule.datasets["train"]) == 1


def test_truncated_rows_are_counted_and_reported_on_every_setup(tmp_path: Path, checkpoint: Path) -> None:
    long_answer = {"prompt": "Hi", "response": "The quick brown fox jumps over the lazy dog. " * 4}
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, long_answer, GOOD, long_answer, GOOD])
    for built in (True, False):  # tokenized now, then found in the cache: the same count
        datamodule = SFTDataModule(path, hf_checkpoint=str(checkpoint), seq_length=24, micro_batch_size=1,
                                   cache_dir=str(tmp_path / "cache"))
        with pytest.warns(UserWarning, match=rf"{path}: cut 2 of 5 rows to their first seq_length=24 tokens "
                                             r"\(overlong='truncate'\)"):
            datamodule.setup("fit")
        assert datamodule.cache_built == {"train": built} and len(datamodule.datasets["train"]) == 5
    long_prompt = {"prompt": long_answer["response"]}
    path = write_jsonl(tmp_path / "prompts.jsonl", [GOOD, long_prompt, GOOD])
    prompts = SFTDataModule(predict_path=path, hf_checkpoint=str(checkpoint), seq_length=24, micro_batch_size=1)
    with pytest.warns(UserWarning, match=rf"{path}: cut 1 of 3 rows to their last seq_length=24 tokens"):
        prompts.setup("predict")


# --- prediction and settings ---------------------------------------------------------------------------------------


def test_predict_batches_are_prompts_ending_at_the_assistant_header(tmp_path: Path, checkpoint: Path,
                                                                    tokenizer: Any) -> None:
    rows = [{"prompt": "What is the capital of France?"}, {"messages": CONVERSATION[:4]}]
    predict = write_jsonl(tmp_path / "predict.jsonl", rows)
    datamodule = SFTDataModule(good_file(tmp_path), predict_path=predict, hf_checkpoint=str(checkpoint),
                               seq_length=128, micro_batch_size=2)
    datamodule.setup("predict")
    (batch,) = list(datamodule.predict_dataloader())
    conversations = [[{"role": "user", "content": rows[0]["prompt"]}], CONVERSATION[:4]]
    for row, conversation in enumerate(conversations):
        length = int(batch["prompt_lengths"][row])
        expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(batch["input_ids"][row, :length]) == expected
        assert (batch["input_ids"][row, length:] == tokenizer.pad_token_id).all()
    assert batch["input_ids"].shape[1] == int(batch["prompt_lengths"].max())

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(DataValidationError, match=rf"{bad}:1: .*must not end with an assistant turn"):
        SFTDataModule(good_file(tmp_path), predict_path=bad, hf_checkpoint=str(checkpoint),
                      micro_batch_size=1).setup("predict")


def test_an_sft_row_as_a_prompt_is_prompted_without_its_response(tmp_path: Path, checkpoint: Path) -> None:
    """The answer ContinuationWriter writes back replaces the response: the model must not see it first."""
    prompts = {}
    for name, row in (("answered", PROMPT_RESPONSE), ("prompt_only", {"prompt": PROMPT_RESPONSE["prompt"]})):
        datamodule = SFTDataModule(predict_path=write_jsonl(tmp_path / f"{name}.jsonl", [row]),
                                   hf_checkpoint=str(checkpoint), seq_length=128, micro_batch_size=1)
        datamodule.setup("predict")
        prompts[name] = next(iter(datamodule.predict_dataloader()))["input_ids"]
    assert torch.equal(prompts["answered"], prompts["prompt_only"])


def test_settings_the_strategy_owns_must_come_from_somewhere(tmp_path: Path, checkpoint: Path) -> None:
    train = good_file(tmp_path)
    with pytest.raises(ValueError, match=r"micro_batch_size is not set .* SFTDataModule\(micro_batch_size=...\)"):
        SFTDataModule(train, hf_checkpoint=str(checkpoint)).setup("fit")
    with pytest.raises(ValueError, match="hf_checkpoint is not set"):
        SFTDataModule(train, micro_batch_size=1).setup("fit")
    with pytest.raises(ValueError, match="packing=True needs micro_batch_size=1"):
        SFTDataModule(train, hf_checkpoint=str(checkpoint), packing=True, micro_batch_size=2).setup("fit")
    with pytest.raises(ValueError, match="seq_length=30 must be a multiple of 2 \\* context_parallel_size = 4"):
        SFTDataModule(train, hf_checkpoint=str(checkpoint), seq_length=30, micro_batch_size=1,
                      context_parallel_size=2).setup("fit")
    with pytest.raises(ValueError, match="test_path is not set"):
        SFTDataModule(train, hf_checkpoint=str(checkpoint), micro_batch_size=1).setup("test")
    datamodule = SFTDataModule(train, hf_checkpoint=str(checkpoint), seq_length=32, micro_batch_size=1)
    datamodule.setup("fit")
    assert datamodule.val_dataloader() == []  # no val_path: Lightning skips validation


def test_settings_the_strategy_hands_in_fill_only_what_was_not_given(tmp_path: Path, checkpoint: Path) -> None:
    from lightning_megatron.data.settings import DataSettings, hand_data_settings
    from lightning_megatron.distributed import ParallelSizes

    settings = DataSettings(str(checkpoint), micro_batch_size=2, parallel=ParallelSizes(context=2), mtp_head=False)
    handed = SFTDataModule(good_file(tmp_path), seq_length=32)
    hand_data_settings(handed, settings)
    handed.setup("fit")
    assert (handed.hf_checkpoint, handed.micro_batch_size, handed.context_parallel_size) == (str(checkpoint), 2, 2)
    given = SFTDataModule(good_file(tmp_path), seq_length=32, micro_batch_size=1, context_parallel_size=1)
    hand_data_settings(given, settings)
    given.setup("fit")
    assert (given.hf_checkpoint, given.micro_batch_size, given.context_parallel_size) == (str(checkpoint), 1, 1)


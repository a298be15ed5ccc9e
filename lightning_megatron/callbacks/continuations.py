"""Write `predict`'s continuations as SFT JSONL: the target model's own answers, to train its MTP head on.

An MTP head is accepted when it drafts what the target says, so the data to train it on is the target's own
continuations of prompts like the ones it will serve: greedy ones for greedy serving, samples at the rollout
temperature (`SFTModule(generation_temperature=...)`) for sampled rollouts; `lightning-megatron predict` with this
callback makes that data from a prompts file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_megatron.atomic import write_text_atomically
from lightning_megatron.contract import MegatronLightningModule
from lightning_megatron.data import SFTDataModule


class ContinuationWriter(pl.Callback):
    """Collect every rank's continuations and write them, in prompt order, to `output_path` (atomically).

    Each row is the prompt row with the answer added, ready for `SFTDataModule`: `{"prompt", "response"}` for a
    prompt row, `{"messages": [..., {"role": "assistant", ...}]}` for a messages row, plus the answer's exact
    `response_token_ids` (what training then uses: decoded text need not tokenize back to the same ids) and
    `finish_reason` (`"eos"` or `"length"`). A prompt answered at once with an end-of-sequence token is left out
    (counted in the log): training on it would teach the head nothing about the answers.

    Args:
        output_path: the JSONL file the rows are written to (atomically), in prompt order.
    """

    def __init__(self, output_path: str) -> None:
        self.output_path = output_path
        self._token_ids: dict[int, list[int]] = {}

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._token_ids = {}

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        for item in outputs:
            self._token_ids[item["index"]] = item["token_ids"]

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = trainer.datamodule
        if not isinstance(pl_module, MegatronLightningModule):
            raise TypeError(f"ContinuationWriter writes the continuations of a MegatronLightningModule (e.g. "
                            f"SFTModule); got {type(pl_module).__name__}")
        if not isinstance(datamodule, SFTDataModule) or not datamodule.predict_examples:
            raise TypeError("ContinuationWriter writes the prompts of an SFTDataModule's predict_path next to their "
                            "continuations; run predict with lightning_megatron.SFTDataModule(predict_path=...)")
        merged: dict[int, list[int]] = {}
        parts: list[Any] = [self._token_ids]
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, self._token_ids)
        for part in parts:
            merged.update(part)
        if not trainer.is_global_zero:
            return
        examples, eos = datamodule.predict_examples, pl_module.generation_eos_token_ids
        rows, empty = [], 0
        for index in sorted(merged):
            token_ids = merged[index]
            finished = bool(token_ids) and token_ids[-1] in eos
            answer_ids = token_ids[:-1] if finished else token_ids
            if not answer_ids:
                empty += 1
                continue
            text = datamodule.tokenizer.decode(answer_ids)
            rows.append(_answered_row(examples[index], text, token_ids, "eos" if finished else "length"))
        if empty:
            rank_zero_warn(f"ContinuationWriter: {empty} of {len(merged)} prompts got an empty answer and are left "
                           f"out of {self.output_path}")
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        write_text_atomically(Path(self.output_path), text)
        rank_zero_info(f"ContinuationWriter: wrote {len(rows)} rows to {self.output_path}")


def _answered_row(example: Any, answer: str, token_ids: list[int], finish_reason: str) -> dict[str, Any]:
    generated = {"response_token_ids": token_ids, "finish_reason": finish_reason}
    if example.messages is not None:
        return {"messages": [*example.as_messages(), {"role": "assistant", "content": answer}], **generated}
    return {"prompt": example.prompt, "response": answer, **generated}



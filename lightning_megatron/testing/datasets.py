"""Random token data shaped as the SFT microbatch rows the module trains on, for tests and benchmarks that need no
real text."""

from __future__ import annotations

import torch


class RandomTokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences as SFT microbatch rows (the first quarter of each is a prompt the loss skips)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_length + 1), generator=generator)
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        loss_mask = torch.ones(self.seq_length)
        loss_mask[: self.seq_length // 4] = 0
        return {"input_ids": tokens[:-1], "labels": tokens[1:], "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq_length)}


"""Prove an MTP head works: self-speculative decoding with the head as drafter (greedy or speculative sampling, K
drafts per step, several prompts at once), its acceptance report with intervals over prompts, and teacher-forced
acceptance metrics for validation."""

from lightning_megatron.mtp.acceptance import MTPAcceptanceAccuracy, MTPSampledAcceptance
from lightning_megatron.speculative.decode import (
    Decoded,
    decode_batch,
    greedy_decode,
    reference_accepts,
    sample_decode,
    speculative_decode,
)
from lightning_megatron.speculative.mtp_head import MTPDraftHead, load_mtp_head, load_target
from lightning_megatron.speculative.report import measure, measure_checkpoint, read_prompts, write_report
from lightning_megatron.speculative.sampling import Sampling

__all__ = [
    "Decoded",
    "MTPAcceptanceAccuracy",
    "MTPDraftHead",
    "MTPSampledAcceptance",
    "decode_batch",
    "greedy_decode",
    "load_mtp_head",
    "load_target",
    "measure",
    "measure_checkpoint",
    "read_prompts",
    "reference_accepts",
    "Sampling",
    "sample_decode",
    "speculative_decode",
    "write_report",
]

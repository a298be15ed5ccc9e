"""Prove an MTP head works: greedy self-speculative decoding with the head as drafter, its acceptance report, and a
teacher-forced acceptance metric for validation."""

from lightning_megatron.mtp.acceptance import MTPAcceptanceAccuracy
from lightning_megatron.speculative.decode import Decoded, greedy_decode, reference_accepts, speculative_decode
from lightning_megatron.speculative.mtp_head import MTPDraftHead, load_mtp_head, load_target
from lightning_megatron.speculative.report import measure, measure_checkpoint, read_prompts, write_report

__all__ = [
    "Decoded",
    "MTPAcceptanceAccuracy",
    "MTPDraftHead",
    "greedy_decode",
    "load_mtp_head",
    "load_target",
    "measure",
    "measure_checkpoint",
    "read_prompts",
    "reference_accepts",
    "speculative_decode",
    "write_report",
]

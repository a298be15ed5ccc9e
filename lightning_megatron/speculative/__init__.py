"""Prove an MTP head works: self-speculative decoding with the head as drafter (greedy or speculative sampling, K
drafts per step, several prompts at once), its acceptance report with intervals over prompts, teacher-forced
acceptance metrics for validation, and the teacher-forced acceptance of the texts a decoder produced."""

from lightning_megatron.mtp.acceptance import MTPAcceptanceAccuracy
from lightning_megatron.speculative.decode import decode_batch, greedy_decode, reference_accepts, speculative_decode
from lightning_megatron.speculative.mtp_head import load_mtp_head, load_target
from lightning_megatron.speculative.report import measure, measure_checkpoint, read_prompts, write_report
from lightning_megatron.speculative.teacher_forced import teacher_forced_acceptance

__all__ = [
    "MTPAcceptanceAccuracy",
    "decode_batch",
    "greedy_decode",
    "load_mtp_head",
    "load_target",
    "measure",
    "measure_checkpoint",
    "read_prompts",
    "reference_accepts",
    "speculative_decode",
    "teacher_forced_acceptance",
    "write_report",
]

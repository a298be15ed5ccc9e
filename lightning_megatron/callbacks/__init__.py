"""Callbacks that shape what Megatron trains (they run before the model is wrapped) or report on it."""

from lightning_megatron.callbacks.mtp_only import MTPOnlyCallback

__all__ = ["MTPOnlyCallback"]

"""Errors that hf_bpd raises for bad input. Each message is one line and says what to do."""


class BPDError(ValueError):
    """Base class of hf_bpd's user-facing errors."""


class BPDConfigError(BPDError):
    """Inconsistent head or decoding settings."""


class BaseModelError(BPDError):
    """The base model cannot be used or loaded (not causal, missing package, fingerprint mismatch)."""


class CheckpointError(BPDError):
    """A heads checkpoint is missing, corrupt, or disagrees with its config."""

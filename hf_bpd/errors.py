"""Errors that hf_bpd raises for bad input. Each message is one line: what is wrong (the argument or file, the
allowed range or what was looked for where) and what to do. This module imports nothing, so the command line can
use it before any heavy import."""


class BPDError(ValueError):
    """Base class of hf_bpd's user-facing errors."""


class BPDConfigError(BPDError):
    """Inconsistent head or decoding settings, or a drafting option out of its range."""


class BPDTypeError(BPDConfigError, TypeError):
    """An argument of the wrong type (a string where an integer is needed, float token ids, ...)."""


class InputError(BPDError):
    """Bad `generate()` inputs: empty or malformed prompts, token ids outside the vocabulary, a requested length
    beyond the base model's positions."""


class BaseModelError(BPDError):
    """The base model cannot be used or loaded (not causal, missing package, fingerprint mismatch)."""


class CheckpointError(BPDError):
    """A heads checkpoint is missing, corrupt, or disagrees with its config."""


class WorkLimitError(BPDConfigError):
    """An option would make one decoding step cost more than its documented ceiling (docs/reliability.md "Ceilings")."""


class MethodSkipped(Exception):
    """A benchmark method that does not apply to this model or machine (no heads, no bundled rescorer, an optional
    package not installed): `hf-bpd bench` reports it as skipped with the message."""

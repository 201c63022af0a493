"""Errors the CLI reports as one clear line (exit code 2) instead of a traceback."""


class EaglespecError(Exception):
    """Base class: a problem with the user's input, files or models, not a bug."""


class CheckpointError(EaglespecError):
    """A head, feature shard or training checkpoint that is missing, corrupt or foreign."""


class HeadMismatchError(EaglespecError):
    """A draft head built for a different target (family, hidden size, vocabulary)."""


class ModelNotFoundError(EaglespecError):
    """An unknown model name or a path that holds no model."""


class ShallowTargetError(EaglespecError, ValueError):
    """A target with too few layers for EAGLE-3's default aux layers: a bad argument to the head's
    constructor (ValueError) and one clear line from the CLI (EaglespecError)."""

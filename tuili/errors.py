"""Errors tuili raises for bad input. Each message names the bad value and what was expected."""


class TuiliError(ValueError):
    """Base class: a user-facing problem with input, never a bug in tuili."""


class CheckpointError(TuiliError):
    """A model path that is missing, incomplete, corrupt or in an unsupported format."""


class UnsupportedModelError(CheckpointError):
    """A readable checkpoint whose architecture or feature tuili cannot run (yet)."""


class RequestError(TuiliError):
    """A request that cannot be served as given (too long, empty, bad parameters)."""

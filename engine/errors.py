"""Errors the engine raises for bad input; each message names the problem and what to change."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """A checkpoint directory is missing files, holds corrupt files or disagrees with its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture is not one the engine implements."""


class InvalidRequestError(EngineError):
    """A request's prompt or sampling parameters are out of range."""


class KVTransferError(EngineError):
    """A KV payload is corrupt, truncated or does not fit this engine's layout."""


class UnknownHandleError(EngineError):
    """A KV handle was never issued, already released or expired."""


class InsufficientMemoryError(EngineError):
    """The model's weights and KV pool do not fit the memory of the device it is to run on."""


class RankFailedError(EngineError):
    """A rank of a tensor/pipeline-parallel engine died or failed; the engine stopped all of them."""


class DeviceError(EngineError):
    """The device the configuration names is not one this machine has."""

"""The one error family the engine raises; every message is meant for a user."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine reports to the app.

    The message says what went wrong and what the user can do about it.

    Attributes:
        kept_tokens: when the error stopped reading a conversation in midway,
            the tokens of it the cache still holds (the next request continues
            from them); None otherwise.
        total_tokens: the conversation's tokens, beside ``kept_tokens``.
    """

    kept_tokens: int | None = None
    total_tokens: int | None = None

    def stopped_reading(self, kept: int, total: int) -> EngineError:
        """This error, saying it stopped a read at ``kept`` of ``total`` tokens."""
        self.kept_tokens, self.total_tokens = kept, total
        return self


class UnsupportedModeError(EngineError, ValueError):
    """A KV mode name is unknown, or the mode cannot store this model's heads."""


class KvBudgetExceeded(EngineError):
    """The page pool's byte budget cannot hold the requested tokens.

    Attributes:
        tokens_requested: tokens the caller tried to hold in total.
        tokens_fit: tokens that fit in the budget in the current mode.
        suggested_mode: a mode that would fit the request, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        tokens_requested: int = 0,
        tokens_fit: int = 0,
        suggested_mode: str | None = None,
    ) -> None:
        super().__init__(message)
        self.tokens_requested = tokens_requested
        self.tokens_fit = tokens_fit
        self.suggested_mode = suggested_mode


class ContextTooLong(EngineError):
    """A prompt does not fit the model's context, the page budget or free RAM."""


class MemoryShort(ContextTooLong):
    """A prompt the model's context holds but the KV budget or free RAM does not now:
    it may fit once memory is freed, or in a smaller mode (not too long for good)."""


class MachineShort(ContextTooLong):
    """Another machine of a pipeline cannot hold its share of a conversation's
    layers; ``machine`` names it as a message does."""

    def __init__(self, message: str, machine: str) -> None:
        super().__init__(message)
        self.machine = machine


class TemplateRefused(EngineError):
    """The model's chat template raised on a conversation (its own rule, in its words)."""


class ModelLoadError(EngineError):
    """A model folder is missing files, corrupt, or of an unknown architecture."""


class DocumentError(EngineError):
    """A dropped or attached file cannot be read as text."""


class DocumentTooLong(DocumentError):
    """A file's text is longer than ``max_chars``; ``chars`` when it was read to the end."""

    def __init__(self, message: str, chars: int | None, max_chars: int) -> None:
        super().__init__(message)
        self.chars, self.max_chars = chars, max_chars


class Cancelled(EngineError):
    """An ingest, a generation, a download or a document's read was cancelled by the user."""


class EngineStopped(EngineError):
    """The engine thread stopped on an unexpected error: no request can run any more."""


class InsufficientMemory(EngineError):
    """A model load (or other allocation) needs more memory than is free.

    Attributes:
        needed_bytes: what the operation needs.
        free_bytes: what is free after the headroom.
    """

    def __init__(self, message: str, *, needed_bytes: int = 0, free_bytes: int = 0) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class MemoryPressure(EngineError):
    """System memory turned critical, so the engine stopped (or did not start) work."""


class DiskFault(EngineError):
    """A folder Longleaf writes to is full, read-only or may not be written.

    Attributes:
        folder: the folder (or file) the write was for, as a string.
        cause: "full", "read-only", "unwritable" or "in use" (another program
            holds the file's write lock).
    """

    def __init__(self, message: str, *, folder: str, cause: str) -> None:
        super().__init__(message)
        self.folder = folder
        self.cause = cause

"""The error a request body raises when the server cannot honour it."""

from __future__ import annotations

from engine.errors import EngineError


class BadRequest(EngineError):
    """A request body the server cannot honour; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

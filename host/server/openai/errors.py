"""The OpenAI API's refusal of a request, shared by the request parsers (openai_schema.py,
openai_tools.py) and the routes (openai.py)."""
from __future__ import annotations

__all__ = ["RequestError"]


class RequestError(ValueError):
    """A request the API refuses; the message names the field, `param` is its path."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code

"""Typed errors of the engine. A caller that batches many owners' requests (the host's scheduler)
fails only the request an error names, by its attributes, never by parsing the message."""
from __future__ import annotations

__all__ = ["RequestError"]


class RequestError(ValueError):
    """One request of a ForwardBatch does not fit the engine; nothing of the batch has run.

    request_index: the request's index in the batch; field: the ForwardRequest field at fault;
    reason: what is wrong with it. str(error) is "request <i>: field <field>: <reason>".
    """

    def __init__(self, request_index: int, field: str, reason: str) -> None:
        super().__init__(f"request {request_index}: field {field}: {reason}")
        self.request_index = request_index
        self.field = field
        self.reason = reason

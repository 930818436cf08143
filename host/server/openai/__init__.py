"""The OpenAI API of `pie serve`: chat and text completions served by the built-in inferlet.

- frontend.py  OpenAIFrontend: the routes, streaming, the built-in's launches
- schema.py    a request checked and normalised (ApiLimits, parse_request)
- tools.py     messages and tool definitions checked
- context.py   the up-front context-length check of a request
- format.py    responses and stream chunks
- errors.py    RequestError: a 4xx naming the field

May import: host.server (its own room), host.runtime and engine (lazily), leaves.
"""
from host.server.openai.frontend import OpenAIFrontend

__all__ = ["OpenAIFrontend"]

"""The OpenAI-compatible HTTP API, served by the built-in inferlet.

Each request is authenticated with its bearer token (the tenant's API token: OpenAI clients send
their api_key this way), counted against that tenant's quotas, and served by one instance of the
built-in inferlet (inferlets/builtin/openai_completions.py), launched like any other instance, so
concurrent requests share the engine's batches. Streaming answers are Server-Sent Events; a client
that goes away mid-stream has its instance terminated (its pages return to the pool).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, AsyncIterator

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from host.server.builtin import BUILTIN_NAME, load_builtin
from host.server.openai_schema import (RequestError, completion_response, parse_request,
                                       stream_chunk)
from host.server.protocol import loads_bounded
from host.server.service import InstanceHandle, PieService, ServiceError
from host.server.sinks import EventSink
from host.server.tenants import Tenant, TenantRegistry

__all__ = ["OpenAIFrontend"]

MAX_BODY_NESTING = 64     # deepest JSON nesting of a request body


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": None}}, status_code=status)


class OpenAIFrontend:
    """Routes /v1/models, /v1/completions, /v1/chat/completions over the service."""

    def __init__(self, service: PieService, tenants: TenantRegistry, program: Any,
                 program_hash: str) -> None:
        self.service = service
        self.tenants = tenants
        self.program = program
        self.program_hash = program_hash
        info = service.model_info()
        self.model = info["name"]
        self.max_context = info["page_size"] * info["num_pages"]

    @classmethod
    async def create(cls, service: PieService, tenants: TenantRegistry,
                     data_dir: Path) -> "OpenAIFrontend":
        """Build (first start only; then cached in data_dir) and compile the built-in inferlet."""
        program, program_hash = await load_builtin(service.runtime, data_dir)
        return cls(service, tenants, program, program_hash)

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]

    def _tenant(self, request: Request) -> Tenant | None:
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            return None
        return self.tenants.authenticate(header[7:].strip())

    async def models(self, request: Request) -> Response:
        if self._tenant(request) is None:
            return _error(401, "invalid or missing bearer token", "authentication_error")
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "pie"}]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, mode: str) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return _error(401, "invalid or missing bearer token", "authentication_error")
        try:
            body = loads_bounded(await request.body(), MAX_BODY_NESTING)
            parsed = parse_request(body, mode, self.max_context)
        except (ValueError, RequestError) as exc:     # JsonNestingError is a ValueError
            return _error(400, str(exc))
        too_long = await trio.to_thread.run_sync(self._context_problem, tenant, parsed)
        if too_long:
            return _error(400, too_long)
        receive = EventSink()
        try:
            handle = await self.service.launch(tenant, self.program, BUILTIN_NAME,
                                               (json.dumps(parsed),), receive)
        except ServiceError as exc:
            return _error(503 if "shutting down" in str(exc) else 429, str(exc),
                          "server_error" if "shutting down" in str(exc) else "rate_limit_error")
        meta = (mode, f"{'chatcmpl' if mode == 'chat' else 'cmpl'}-{handle.instance_id}",
                self.model, int(time.time()))
        if parsed["stream"]:
            return StreamingResponse(self._stream(handle, receive, parsed, meta),
                                     media_type="text/event-stream")
        try:
            final = await _final_event(receive)
        finally:
            receive.close()
            with trio.CancelScope(shield=True):
                await self.service.terminate_and_wait([handle], "http request ended")
        if final.kind != "result":
            return _error(500, f"generation failed ({final.kind}): {final.data}", "server_error")
        return JSONResponse(completion_response(*meta, json.loads(final.data)))

    def _context_problem(self, tenant: Tenant, parsed: dict) -> str | None:
        """Why the prompt and max_tokens do not fit one request's context, or None. The context
        is the model's (max_position) or what the tenant's per-instance KV reservation holds,
        whichever is smaller; the prompt is counted as the built-in inferlet will encode it."""
        engine = self.service.runtime.engine
        tokenizer = engine.tokenizer
        if parsed["mode"] == "chat":
            try:
                text = tokenizer.render_chat([{"role": role, "content": content}
                                              for role, content in parsed["messages"]], True)
            except ValueError as exc:
                return str(exc)
        else:
            text = parsed["prompt"]
        num_prompt = len(tokenizer.encode(text))
        max_position = getattr(getattr(engine, "model_config", None), "max_position", None)
        context = min(self.max_context, tenant.default_kv_pages * engine.page_size,
                      max_position or self.max_context)
        if num_prompt + parsed["max_tokens"] <= context:
            return None
        return (f"the context length is {context} tokens, but {num_prompt + parsed['max_tokens']} "
                f"were requested ({num_prompt} in the prompt, max_tokens {parsed['max_tokens']})")

    async def _stream(self, handle: InstanceHandle, receive: EventSink,
                      parsed: dict, meta: tuple) -> AsyncIterator[str]:
        started: set[int] = set()
        try:
            async for event in receive:
                if event.kind == "message":
                    delta = json.loads(event.data)
                    first = delta["index"] not in started
                    started.add(delta["index"])
                    yield _sse(stream_chunk(*meta, delta["index"], delta["delta"], first=first))
                    continue
                if event.kind != "result":
                    yield _sse({"error": {"message": f"generation failed ({event.kind}): "
                                          f"{event.data}", "type": "server_error"}})
                    break
                result = json.loads(event.data)
                for choice in result["choices"]:
                    yield _sse(stream_chunk(*meta, choice["index"], None, choice["finish_reason"],
                                            first=choice["index"] not in started))
                if parsed["include_usage"]:
                    yield _sse(stream_chunk(*meta, None, usage=result["usage"]))
                yield "data: [DONE]\n\n"
                break
        finally:
            receive.close()
            with trio.CancelScope(shield=True):
                await self.service.terminate_and_wait([handle], "http client went away")


async def _final_event(receive: EventSink) -> Any:
    async for event in receive:
        if event.kind != "message":
            return event
    raise ServiceError("the instance ended without a final event")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

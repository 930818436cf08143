"""The OpenAI-compatible HTTP API, served by the built-in inferlet.

Each request is authenticated with its bearer token (the tenant's API token: OpenAI clients send
their api_key this way), counted against that tenant's quotas, and served by one instance of the
built-in inferlet (inferlets/builtin/openai_completions.py), launched like any other instance, so
concurrent requests share the engine's batches. Streaming answers are Server-Sent Events; a client
that goes away mid-stream has its instance terminated (its pages return to the pool). A tenant's
LoRA adapters (uploaded over the websocket) are models "<id>:<adapter>", listed in /v1/models.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator

import anyio.lowlevel
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from host.server.builtin import (BUILTIN_NAME, load_builtin, warm_up_builtin,
                                 warm_up_prefixes)
from host.server.openai.context import ContextLimits, context_problem, prompt_lengths
from host.server.openai.format import completion_response, stream_chunk
from host.server.openai.schema import ApiLimits, RequestError, parse_request
from host.server.protocol import loads_bounded
from host.server.service import InstanceHandle, PieService, ServiceError
from host.server.sinks import EventSink
from host.server.tenants import Tenant, TenantRegistry

__all__ = ["OpenAIFrontend", "load_stream_backend"]

MAX_BODY_NESTING = 64     # deepest JSON nesting of a request body


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def api_limits(info: dict[str, Any]) -> ApiLimits:
    """The model's ids and limits. The listed id is the served model's one name, info["name"]
    (engine.loaders.served_model_name; "SmolLM2-135M-Instruct" for the embedded
    SmolLM2-135M-Instruct.Q4_1.gguf); the model's own metadata name, the file name and the
    path are accepted as aliases."""
    path = info.get("path") or ""
    if not path:
        from engine.loaders import default_gguf_path
        path = str(default_gguf_path())
    file_name = Path(path).name
    listed = info["name"]
    aliases = {listed, info.get("metadata_name") or listed, file_name, path,
               str(Path(path).resolve())}
    max_context = min(info["page_size"] * info["num_pages"],
                      info.get("max_position") or info["page_size"] * info["num_pages"])
    return ApiLimits(frozenset(aliases), listed, max_context, info["vocab_size"])


async def load_stream_backend() -> None:
    """Import AnyIO's backend for the running event loop (trio) now, before the server listens:
    Starlette's StreamingResponse asks AnyIO for a task group, and AnyIO imports its backend
    module at that first use, which would otherwise delay the first streamed answer's first
    token (the warm-up run does not stream through HTTP)."""
    await anyio.lowlevel.checkpoint()


class OpenAIFrontend:
    """Routes /v1/models, /v1/completions, /v1/chat/completions over the service."""

    def __init__(self, service: PieService, tenants: TenantRegistry, program: Any,
                 program_hash: str) -> None:
        self.service = service
        self.tenants = tenants
        self.program = program
        self.program_hash = program_hash
        self.limits = api_limits(service.model_info())
        self.model = self.limits.listed_id

    @classmethod
    async def create(cls, service: PieService, tenants: TenantRegistry, data_dir: Path, *,
                     warm_prefixes: bool = True, spare_builtins: int = 0
                     ) -> "OpenAIFrontend":
        """Build (first start only; then cached in data_dir) and compile the built-in inferlet,
        then run it once, and (`warm_prefixes`) once per tenant that shares chat prefixes
        (host/server/builtin.py: warm_up_builtin, warm_up_prefixes); then keep
        `spare_builtins` instances of it instantiated ahead (Runtime.keep_spares)."""
        program, program_hash = await load_builtin(service.runtime, data_dir)
        frontend = cls(service, tenants, program, program_hash)
        warm_up = parse_request({"model": frontend.model, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "Hello"}]},
                                "chat", frontend.limits)
        await trio.to_thread.run_sync(warm_up_builtin, service.runtime, program, warm_up)
        if warm_prefixes:
            await trio.to_thread.run_sync(warm_up_prefixes, service.runtime, program, warm_up,
                                          tenants.all(), service.limits)
        service.runtime.keep_spares(program, spare_builtins, limits=service.limits)
        await load_stream_backend()
        return frontend

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model_by_id, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/{rest:path}", self.not_found,
                      methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]

    def _tenant(self, request: Request) -> Tenant | None:
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            return None
        return self.tenants.authenticate(header[7:].strip())

    async def models(self, request: Request) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return _error(401, "invalid or missing bearer token", "authentication_error")
        adapters = sorted(await self._adapter_names(tenant))
        return JSONResponse({"object": "list", "data": [
            self._model_object(tenant), *(self._model_object(tenant, a) for a in adapters)]})

    async def _adapter_names(self, tenant: Tenant) -> frozenset[str]:
        """The names of the tenant's LoRA adapters."""
        return frozenset(a.name for a in await self.service.list_adapters(tenant))

    def _model_object(self, tenant: Tenant, adapter: str | None = None) -> dict[str, Any]:
        """The model as OpenAI lists it, with vLLM's `max_model_len`: the context one request
        of this tenant may use (what `_context_limits` enforces); an adapter as vLLM lists a
        LoRA: "<id>:<adapter>", its `parent` the base model."""
        model = {"id": self.model if adapter is None else f"{self.model}:{adapter}",
                 "object": "model", "created": 0, "owned_by": "pie" if adapter is None
                 else tenant.name, "root": self.model, "parent": None if adapter is None
                 else self.model, "max_model_len": self._context_limits(tenant).max_sequence_tokens}
        return model

    async def model_by_id(self, request: Request) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return _error(401, "invalid or missing bearer token", "authentication_error")
        model = request.path_params["model"]
        if model in self.limits.model_ids:
            return JSONResponse(self._model_object(tenant))
        base, colon, adapter = model.rpartition(":")
        if colon and base in self.limits.model_ids and adapter in await self._adapter_names(tenant):
            return JSONResponse(self._model_object(tenant, adapter))
        return _error(404, f"The model '{model}' does not exist", param="model",
                      code="model_not_found")

    async def not_found(self, request: Request) -> Response:
        return _error(404, f"no such endpoint: {request.method} {request.url.path}",
                      code="not_found")

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
        except ValueError as exc:     # not JSON, or nested past MAX_BODY_NESTING (JsonNestingError)
            return _error(400, f"the request body is not valid JSON: {exc}")
        context = self._context_limits(tenant)
        model = body.get("model") if isinstance(body, dict) else None
        adapters = await self._adapter_names(tenant) if isinstance(model, str) \
            and model not in self.limits.model_ids and ":" in model else frozenset()
        try:
            parsed = parse_request(body, mode, replace(
                self.limits, max_context=context.max_sequence_tokens, adapters=adapters))
        except RequestError as exc:
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            return _error(exc.status, str(exc), kind, exc.param, exc.code)
        too_long = await trio.to_thread.run_sync(self._context_problem, context, parsed)
        if too_long:
            param = "messages" if mode == "chat" and too_long[0] == "prompt" else too_long[0]
            return _error(400, too_long[1], param=param, code="context_length_exceeded")
        receive = EventSink()
        try:
            argument = json.dumps(dict(parsed, prefix_cache_pages=tenant.prefix_cache_pages))
            handle = await self.service.launch(tenant, self.program, BUILTIN_NAME, (argument,),
                                               receive, affinity=_affinity(body))
        except ServiceError as exc:
            return _error(503 if "shutting down" in str(exc) else 429, str(exc),
                          "server_error" if "shutting down" in str(exc) else "rate_limit_error")
        meta = (mode, f"{'chatcmpl' if mode == 'chat' else 'cmpl'}-{handle.instance_id}",
                self.model if parsed["adapter"] is None else f"{self.model}:{parsed['adapter']}",
                int(time.time()))
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

    def _context_limits(self, tenant: Tenant) -> ContextLimits:
        """What one request of `tenant` may hold. One sequence's context is the model's
        (max_position), the pool's or the tenant's per-instance KV reservation, whichever is
        smallest: the one figure every refusal and /v1/models name; all the request's choices
        together must fit that reservation."""
        engine = self.service.runtime.engine
        max_position = getattr(getattr(engine, "model_config", None), "max_position", None)
        max_pages = min(tenant.default_kv_pages, self.service.model_info()["num_pages"])
        return ContextLimits(min(self.limits.max_context, max_pages * engine.page_size,
                                 max_position or self.limits.max_context),
                             max_pages, engine.page_size)

    def _context_problem(self, limits: ContextLimits, parsed: dict) -> tuple[str, str] | None:
        """(parameter, why) when the prompts, max_tokens and n do not fit `limits`, or None
        (see context.py)."""
        engine = self.service.runtime.engine
        lengths = prompt_lengths(parsed, engine.tokenizer.encode, engine.tokenizer.render_chat)
        if lengths is None:
            return None
        return context_problem(lengths, parsed["n"], parsed["max_tokens"], limits)

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
                                            first=choice["index"] not in started, choice=choice))
                if parsed["include_usage"]:
                    yield _sse(stream_chunk(*meta, None, usage=result["usage"]))
                yield "data: [DONE]\n\n"
                break
        finally:
            receive.close()
            with trio.CancelScope(shield=True):
                await self.service.terminate_and_wait([handle], "http client went away")


def _affinity(body: dict) -> str | None:
    """The request's session key for placement on a cluster (`pie serve --ray`): its `user`,
    when a string of 1..256 characters (else none: placed by load)."""
    user = body.get("user")
    return user if isinstance(user, str) and 0 < len(user) <= 256 else None


async def _final_event(receive: EventSink) -> Any:
    async for event in receive:
        if event.kind != "message":
            return event
    raise ServiceError("the instance ended without a final event")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

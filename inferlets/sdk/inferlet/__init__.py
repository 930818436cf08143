"""inferlet: the Python SDK for writing pie inferlets (bundled into every component).

    import inferlet

    @inferlet.main
    def main(args: list[str]) -> str:
        ctx = inferlet.Context()
        ctx.fill_user("Write a haiku about the sea.")
        return ctx.generate(max_tokens=64)

See docs/writing-inferlets.md for the whole API.
"""
from inferlet import drafting, http, mcp, sampling, speculative
from inferlet.adapters import Adapter, available_adapters, open_adapter
from inferlet.beam import Beam, beam_search
from inferlet.children import Child, ChildError, spawn
from inferlet.context import Context, list_exports, release_export
from inferlet.entry import ArgumentParser, main
from inferlet.errors import InferletError
from inferlet.drafting import PromptLookupDrafter
from inferlet.generation import Generation, TokenLogprob, generate_parallel, wait_outputs
from inferlet.host_loop import HostLoop
from inferlet.messaging import (Subscription, broadcast, receive, receive_json, send, send_json,
                                store_delete, store_get, store_set, subscribe, try_receive)
from inferlet.model import (ModelInfo, arguments, decode, encode, host_version, instance_id, log,
                            model_info, render_chat, suspended_ms, vocabulary)
from inferlet.sampling import Sampler
from inferlet.sharing import prefix_context, shared_system_context

__all__ = [
    "Adapter", "available_adapters", "open_adapter",
    "Child", "ChildError", "spawn",
    "http", "mcp",
    "ArgumentParser", "Beam", "Context", "Generation", "HostLoop", "InferletError", "ModelInfo",
    "PromptLookupDrafter", "Sampler", "TokenLogprob", "drafting", "speculative", "wait_outputs",
    "Subscription", "arguments", "beam_search", "broadcast", "decode", "encode",
    "generate_parallel", "host_version", "instance_id", "list_exports", "log", "main",
    "model_info", "prefix_context", "receive", "receive_json", "release_export", "render_chat",
    "sampling", "send", "send_json", "shared_system_context", "store_delete", "store_get",
    "store_set", "subscribe", "suspended_ms", "try_receive", "vocabulary",
]

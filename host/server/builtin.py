"""The built-in OpenAI inferlet: built with `pie build` at the server's first start, then cached.

The component is cached under `<data_dir>/builtin/` keyed by the hash of its source, the SDK and
the WIT (host.sandbox.programs.build.build_cached), so a later start (or a changed SDK) builds
only when needed; the runtime then compiles it (with its own on-disk cache of compiled
artifacts). Once loaded, it runs once on a two-token chat (`warm_up_builtin`) before the server
listens, so that the first client does not pay what a first run costs (instantiating the
built-in on fresh memory). Then, for every tenant that shares chat prefixes, it runs once more
as that tenant (`warm_up_prefixes`), which leaves the tenant's default chat prefix (the system
prompt the template adds) computed and exported: a tenant's first chat without a system prompt
of its own imports it instead of computing it in a pass of its own.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import trio

from host.progress import progress
from host.runtime_config import InstanceLimits
from host.server.tenants import Tenant

__all__ = ["BUILTIN_NAME", "WARM_UP_TENANT", "builtin_source", "build_builtin", "load_builtin",
           "warm_up_builtin", "warm_up_prefixes"]

BUILTIN_NAME = "builtin:openai"
WARM_UP_TENANT = "pie.warm-up"    # the runtime tenant of the warm-up run (no configured tenant)
WARM_UP_TIMEOUT_S = 60.0
PREFIX_WAVE = 8                   # tenants' prefix runs launched at once (warm_up_prefixes)
_log = logging.getLogger("host.server.builtin")
_progress_log = logging.getLogger("pie.serve")   # `pie serve` shows it on stderr


def _step(what: str) -> progress:
    """A slow step of the server's start, reported on the "pie.serve" log past 2 s."""
    return progress("", what, write=_progress_log.info)


def builtin_source() -> Path:
    from inferlets.builtin import BUILTIN_DIR
    return BUILTIN_DIR / "openai_completions.py"


def build_builtin(data_dir: Path) -> bytes:
    """The built-in component's bytes (built now unless cached in data_dir/builtin)."""
    from host.sandbox.programs.build import build_cached
    path, _ = build_cached(builtin_source(), Path(data_dir) / "builtin")
    return path.read_bytes()


async def load_builtin(runtime: Any, data_dir: Path) -> tuple[Any, str]:
    """(compiled Program, sha256) of the built-in inferlet; blocking work runs in threads."""
    with _step("building the built-in OpenAI inferlet (componentize-py; first start only)"):
        data = await trio.to_thread.run_sync(build_builtin, data_dir)
    with _step("compiling the built-in OpenAI inferlet (cached afterwards)"):
        program = await trio.to_thread.run_sync(runtime.load_program, data)
    return program, hashlib.sha256(data).hexdigest()


def warm_up_builtin(runtime: Any, program: Any, request: dict[str, Any]) -> bool:
    """Run the built-in once on `request` (a normalised request, openai_schema.parse_request)
    with prefix sharing off, and wait for it (blocking; at most WARM_UP_TIMEOUT_S). True when it
    ended well; a failure is logged, never raised: the server starts either way."""
    argument = json.dumps(dict(request, prefix_cache_pages=0))
    with _step("warming up the built-in OpenAI inferlet (one two-token chat)"):
        instance_id = _launch(runtime, program, argument, WARM_UP_TENANT, None)
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        return instance_id is not None and _ended_well(runtime, instance_id, deadline)


def warm_up_prefixes(runtime: Any, program: Any, request: dict[str, Any],
                     tenants: Sequence[Tenant], limits: InstanceLimits) -> int:
    """Run the built-in on the chat `request` once as each of `tenants` whose
    prefix_cache_pages is not 0, with that setting and the page quota a request of
    the tenant gets (`limits`, the service's InstanceLimits, with the tenant's default_kv_pages):
    each run leaves the tenant's default chat prefix exported, as its first request would.
    PREFIX_WAVE runs at a time (their passes batch), each wave at most WARM_UP_TIMEOUT_S;
    blocking. Returns how many ended well; a failure is logged, never raised."""
    sharing = [tenant for tenant in tenants if tenant.prefix_cache_pages > 0]
    if not sharing:
        return 0
    _log.info("computing the default chat prefix of %d tenants (server.warm_prefixes)",
              len(sharing))
    with _step(f"computing the default chat prefix of {len(sharing)} tenants"):
        num_done = _prefix_waves(runtime, program, request, sharing, limits)
    _log.info("computed the default chat prefix of %d of %d tenants", num_done, len(sharing))
    return num_done


def _prefix_waves(runtime: Any, program: Any, request: dict[str, Any],
                  sharing: Sequence[Tenant], limits: InstanceLimits) -> int:
    """warm_up_prefixes' runs, PREFIX_WAVE at a time; how many ended well."""
    num_done = 0
    for start in range(0, len(sharing), PREFIX_WAVE):
        launched = [_launch(runtime, program,
                            json.dumps(dict(request, prefix_cache_pages=tenant.prefix_cache_pages)),
                            tenant.name, replace(limits, page_quota=tenant.default_kv_pages))
                    for tenant in sharing[start:start + PREFIX_WAVE]]
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        num_done += sum(_ended_well(runtime, instance_id, deadline) for instance_id in launched
                        if instance_id is not None)
    return num_done


def _launch(runtime: Any, program: Any, argument: str, tenant: str,
            limits: InstanceLimits | None) -> str | None:
    """The id of a warm-up run of the built-in as `tenant`, or None (logged) if it did not start."""
    try:
        return runtime.launch(program, (argument,), tenant=tenant, limits=limits)
    except Exception:                     # noqa: BLE001 -- a warm-up must not stop the server
        _log.exception("the built-in's warm-up run (tenant %s) could not start", tenant)
        return None


def _ended_well(runtime: Any, instance_id: str, deadline: float) -> bool:
    """Wait for a warm-up run until `deadline` (time.monotonic()), then terminate it; True when
    it ended well, else False, logged."""
    try:
        outcome = runtime.wait(instance_id, timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        runtime.terminate(instance_id, "warm-up timed out")
        _log.warning("the built-in's warm-up run took over %s s: terminated", WARM_UP_TIMEOUT_S)
        return False
    if outcome.status != "ok":
        _log.warning("the built-in's warm-up run did not end well: %s", outcome)
        return False
    return True

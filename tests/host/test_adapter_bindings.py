"""`pie:inferlet/adapters`: handles, sequence bindings, and the adapter's name on every pass of a
bound sequence (forward.submit and a host decode loop's every pass, in each scheduling mode),
over the fake engine."""
from __future__ import annotations

import pytest

from host.bindings import adapters, forward
from host.bindings.adapters import MAX_ADAPTER_HANDLES, AdapterTable
from host.errors import TrapError
from tests.host.test_decode_loop import MODES, PAGE_SIZE, Setup, _sampler


class _Store:
    """The engine's adapter store as the binding sees it (engine.adapters.AdapterStore):
    engine names, unscoped ("tone") or a tenant's ("t/mine"), resolved per tenant."""

    def __init__(self, *names: str) -> None:
        self.names = tuple(sorted(names))

    def resolve(self, name: str, scope: str | None = None) -> str | None:
        if scope is not None and f"{scope}/{name}" in self.names:
            return f"{scope}/{name}"
        return name if name in self.names and "/" not in name else None

    def names_in(self, scope: str | None) -> tuple[str, ...]:
        return tuple(sorted({n for n in self.names if "/" not in n} | {
            n.split("/", 1)[1] for n in self.names if n.startswith(f"{scope}/")}))


def _setup(mode: str, prompt=(5, 6, 7, 8, 9), tenant: str = "t") -> Setup:
    setup = Setup(list(prompt), **MODES[mode])
    setup.engine.adapters = _Store("tone", "code", "t/mine", "u/theirs")
    setup.ctx.services.engine = setup.engine
    setup.ctx.tenant = tenant
    return setup


def test_handles_are_per_name_and_bounded():
    table = AdapterTable()
    first = table.open("adapters.open", "a")
    assert table.open("adapters.open", "a") == first
    assert table.open("adapters.open", "b") != first
    with pytest.raises(TrapError, match="unknown adapter handle 99"):
        table.name_of("adapters.bind", 99)
    assert table.name_of("adapters.bind", first) == "a" and table.handle_of("a") == first
    for k in range(MAX_ADAPTER_HANDLES - 2):
        table.open("adapters.open", f"n{k}")
    with pytest.raises(TrapError, match="already open"):
        table.open("adapters.open", "one-more")


def test_open_refuses_unknown_and_overlong_names():
    setup = _setup("no-overlap")
    try:
        assert adapters.available(setup.ctx) == ["code", "mine", "tone"]
        assert isinstance(adapters.open_adapter(setup.ctx, "tone"), int)
        assert "no adapter named 'nope'" in adapters.open_adapter(setup.ctx, "nope")
        assert "at most" in adapters.open_adapter(setup.ctx, "x" * 100)
        setup.ctx.services.engine = object()                  # an engine without adapters
        assert "no adapter" in adapters.open_adapter(setup.ctx, "tone")
        assert adapters.available(setup.ctx) == []
    finally:
        setup.close()


def _requests_of(setup: Setup):
    return [request for batch in setup.engine.batches for request in batch.requests]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_bound_sequence_runs_every_decode_pass_with_its_adapter(mode):
    setup = _setup(mode)
    try:
        setup.start()
        handle = adapters.open_adapter(setup.ctx, "tone")
        adapters.bind(setup.ctx, setup.sequence_id, handle)
        assert adapters.bound(setup.ctx, setup.sequence_id) == handle
        outputs = setup.read_all(setup.submit(12))
        assert len(outputs) == 12
        requests = _requests_of(setup)
        assert len(requests) >= 12 and {r.adapter for r in requests} == {"tone"}
    finally:
        setup.close()


def test_an_unbound_sequence_and_a_forward_submit():
    setup = _setup("no-overlap")
    try:
        setup.start()
        setup.read_all(setup.submit(3))
        assert {r.adapter for r in _requests_of(setup)} == {None}
        handle = adapters.open_adapter(setup.ctx, "code")
        adapters.bind(setup.ctx, setup.sequence_id, handle)
        num_pages = len(setup.pages.sequence_pages(setup.sequence_id))
        kv_len = len(setup.prompt) + 3        # the prompt, 2 outputs in the KV, this pass's token
        resource = forward.submit(setup.ctx, setup.queue_id, setup.sequence_id, [1], [kv_len - 1],
                                  kv_len - (num_pages - 1) * PAGE_SIZE, [0], [_sampler()], None)
        assert not isinstance(forward.get(setup.ctx, None, resource.rep), str)
        assert _requests_of(setup)[-1].adapter == "code"
    finally:
        setup.close()


def test_a_tenant_opens_its_own_adapters_and_no_other_tenants():
    setup = _setup("no-overlap")
    try:
        setup.start()
        handle = adapters.open_adapter(setup.ctx, "mine")
        assert "no adapter named 'theirs'" in adapters.open_adapter(setup.ctx, "theirs")
        assert "no adapter" in adapters.open_adapter(setup.ctx, "u/theirs")
        adapters.bind(setup.ctx, setup.sequence_id, handle)
        setup.read_all(setup.submit(2))
        assert {r.adapter for r in _requests_of(setup)} == {"t/mine"}   # the engine's name
    finally:
        setup.close()


def test_bind_traps_on_an_unknown_handle_or_sequence_and_unbinds():
    setup = _setup("no-overlap")
    try:
        handle = adapters.open_adapter(setup.ctx, "tone")
        with pytest.raises(TrapError, match="unknown adapter handle 99"):
            adapters.bind(setup.ctx, setup.sequence_id, 99)
        with pytest.raises(TrapError, match="adapters.bind: unknown sequence"):
            adapters.bind(setup.ctx, 12345, handle)
        adapters.bind(setup.ctx, setup.sequence_id, handle)
        assert adapters.bound(setup.ctx, setup.sequence_id) == handle
        adapters.bind(setup.ctx, setup.sequence_id, None)
        assert adapters.bound(setup.ctx, setup.sequence_id) is None
        assert adapters.bound(setup.ctx, 12345) is None
    finally:
        setup.close()


def test_destroying_a_sequence_forgets_its_binding():
    from host.bindings import kv

    setup = _setup("no-overlap")
    try:
        handle = adapters.open_adapter(setup.ctx, "tone")
        adapters.bind(setup.ctx, setup.sequence_id, handle)
        kv.destroy_sequence(setup.ctx, setup.sequence_id)
        assert adapters.bound(setup.ctx, setup.sequence_id) is None
    finally:
        setup.close()

"""Shared fixtures for host tests: a fake engine, a page pool with its export registry, and a
factory for per-instance resource tables. Small on purpose (tiny pools, exact page ids)."""
from __future__ import annotations

import pytest

from host.kv import ExportRegistry, InstancePages, PageAllocator
from tests.host.fake_engine import FakeEngine


@pytest.fixture
def fake_engine() -> FakeEngine:
    """64 pages of 4 tokens."""
    return FakeEngine(num_pages=64, page_size=4)


@pytest.fixture
def pool() -> PageAllocator:
    return PageAllocator(8)


@pytest.fixture
def exports(pool: PageAllocator) -> ExportRegistry:
    return ExportRegistry(pool)


@pytest.fixture
def make_resources(pool: PageAllocator, exports: ExportRegistry):
    """make_resources(instance_id="a", tenant="t", page_quota=8, page_size=4, reclaim=None,
    vocab_size=None); every table made is released at teardown."""
    made: list[InstancePages] = []

    def make(instance_id: str = "a", *, tenant: str = "t", page_quota: int = 8,
             page_size: int = 4, reclaim=None, vocab_size=None) -> InstancePages:
        resources = InstancePages(pool, exports, instance_id=instance_id, tenant=tenant,
                                      page_quota=page_quota, page_size=page_size, reclaim=reclaim,
                                      vocab_size=vocab_size)
        made.append(resources)
        return resources

    yield make
    for resources in made:
        resources.release_all()

"""Config validation at load: every mistake is a ConfigError naming the file and the field."""
from __future__ import annotations

import gc

import pytest
import torch

from host.server.server_config import ConfigError, load_config, parse_config
from host.server.setup import load_engine_for


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """build_runtime freezes the process's heap, as `pie serve` does: undone after each test."""
    yield
    gc.unfreeze()


TENANT = {"name": "a", "token": "t"}


@pytest.mark.parametrize("data, expected", [
    ({}, "at least one [[tenants]]"),
    ({"tenants": [{**TENANT, "max_instances": 0}]}, "max_instances must be positive, got 0"),
    ({"tenants": [{**TENANT, "max_instances": "3"}]}, "expected int, got str '3' @ pie.toml.tenants[0].max_instances"),
    ({"tenants": [TENANT], "engine": {"page_size": 3}}, "engine.page_size must be a power of two"),
    ({"tenants": [TENANT], "engine": {"kv_dtype": "int8"}}, "engine.kv_dtype must be one of"),
    ({"tenants": [TENANT], "engine": {"max_pass_tokens": 0}}, "engine.max_pass_tokens must be positive"),
    ({"tenants": [TENANT], "engine": {"act8": 1}}, "expected bool, got int 1 @ pie.toml.engine.act8"),
    ({"tenants": [TENANT], "engine": {"cuda_graph_batch_sizes": [4, 2]}},
     "engine.cuda_graph_batch_sizes must be positive ints, strictly increasing"),
    ({"tenants": [TENANT], "server": {"openai": 1}}, "expected bool, got int 1 @ pie.toml.server.openai"),
    ({"tenants": [TENANT], "bogus": {}}, "extra fields found (bogus)"),
    ({"tenants": [TENANT, {"name": "a", "token": "u"}]}, "duplicate tenant name"),
    ({"tenants": [TENANT, {"name": "b", "token": "t"}]}, "two tenants share one token"),
    ({"tenants": [{"name": "a b", "token": "t"}]}, "name must be non-empty letters"),
    ({"tenants": [{"name": "a"}]}, "exactly one of token, token_env"),
    ({"tenants": [TENANT], "scheduler": {"policy": "fifo"}}, "scheduler.policy must be"),
    ({"tenants": [TENANT], "scheduler": {"max_hold_ms": -1}}, "scheduler.max_hold_ms must be >= 0, got -1"),
    ({"tenants": [TENANT], "scheduler": {"start_hold_ms": -5}}, "scheduler.start_hold_ms must be >= 0, got -5"),
    ({"tenants": [TENANT], "scheduler": {"chain_steps": 0}}, "scheduler.chain_steps must be an int in 1..64, got 0"),
    ({"tenants": [TENANT], "server": {"port": 70000}}, "server.port must be in 0..65535"),
    ({"tenants": [TENANT], "server": {"spare_builtins": 65}},
     "server.spare_builtins must be an int in 0..64, got 65"),
    ({"tenants": [{**TENANT, "spare_instances": -1}]},
     "tenant 'a': spare_instances must be an int in 0..64, got -1"),
    ({"tenants": [{**TENANT, "spare_instances": 40}, {"name": "b", "token": "u",
                                                      "spare_instances": 20}]},
     "server.spare_builtins and the tenants' spare_instances add up to 68, past the 64"),
    ({"tenants": [TENANT], "scheduler": {"overlap": 1}},
     "expected bool, got int 1 @ pie.toml.scheduler.overlap"),
    ({"tenants": [{**TENANT, "prefix_cache_pages": -1}]},
     "prefix_cache_pages must be in 0..4096 (max_kv_pages), got -1"),
    ({"tenants": [{**TENANT, "max_kv_pages": 64, "prefix_cache_pages": 65}]},
     "prefix_cache_pages must be in 0..64 (max_kv_pages), got 65"),
    ({"tenants": [{**TENANT, "outbound": {"allow_hosts": "api.example.com"}}]},
     "expected a list of strings, got str 'api.example.com' @ pie.toml.tenants[0].outbound"),
    ({"tenants": [{**TENANT, "outbound": {"allow_hosts": ["http://a.com"]}}]},
     "allow_hosts: 'http://a.com'"),
    ({"tenants": [{**TENANT, "outbound": {"requests_per_minute": 0}}]},
     "OutboundLimits.requests_per_minute must be in 1..1000000, got 0"),
    ({"tenants": [{**TENANT, "outbound": {"mcp_servers": [{"name": "c"}]}}]},
     "MCP server 'c': give exactly one of url, command"),
])
def test_invalid_configs_are_named(data: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert expected in str(error.value)


def test_cuda_graph_settings_reach_the_engine_config() -> None:
    engine = parse_config({"tenants": [TENANT], "engine": {
        "cuda_graphs": False, "cuda_graph_batch_sizes": [1, 2, 8]}}).engine.to_engine_config()
    assert engine.cuda_graphs is False and engine.cuda_graph_batch_sizes == (1, 2, 8)
    default = parse_config({"tenants": [TENANT]}).engine.to_engine_config()
    assert default.cuda_graphs and default.cuda_graph_batch_sizes[:3] == (1, 2, 4)


def test_prefix_cache_pages_default_to_32_but_a_sixteenth_of_the_tenants_pages() -> None:
    tenants = parse_config({"tenants": [
        TENANT, {"name": "b", "token": "u", "max_kv_pages": 160},
        {"name": "c", "token": "v", "max_kv_pages": 160, "prefix_cache_pages": 0}]}).tenants
    assert [t.resolved_prefix_cache_pages for t in tenants] == [32, 10, 0]


def test_load_config_reads_toml_and_names_the_file(tmp_path) -> None:
    path = tmp_path / "pie.toml"
    path.write_text('[server]\nport = 9000\n[engine]\nnum_pages = 64\nkv_dtype = "float32"\n'
                    'max_pass_tokens = 256\nact8 = true\n[[tenants]]\nname = "a"\ntoken = "t"\n'
                    'max_kv_pages = 32\n')
    config = load_config(path)
    assert config.server.port == 9000
    assert config.engine.to_engine_config().num_pages == 64
    assert config.engine.to_engine_config().kv_dtype == "float32"
    assert config.engine.to_engine_config().max_pass_tokens == 256
    assert config.engine.to_engine_config().act8 is True
    assert config.tenants[0].max_kv_pages == 32
    path.write_text("[server\n")
    with pytest.raises(ConfigError, match=f"{path}: invalid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_token_env_is_resolved(monkeypatch) -> None:
    config = parse_config({"tenants": [{"name": "a", "token_env": "PIE_TEST_TOKEN"}]})
    monkeypatch.delenv("PIE_TEST_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="PIE_TEST_TOKEN is unset"):
        config.tenants[0].resolved_token()
    monkeypatch.setenv("PIE_TEST_TOKEN", "secret")
    assert config.tenants[0].resolved_token() == "secret"


def test_serve_counts_linear_memory_unless_turned_off() -> None:
    """`pie serve` names the memory limit whenever an instance hits it (host-created memories),
    unless the config turns that off."""
    from host.server.setup import build_runtime
    from tests.host.fake_engine import FakeEngine

    tenants = [{"name": "a", "token": "t"}]
    for server, counted in (({}, True), ({"count_linear_memory": False}, False)):
        config = parse_config({"server": server, "tenants": tenants})
        assert config.server.count_linear_memory is counted
        runtime = build_runtime(config, FakeEngine(num_pages=16, page_size=4))
        try:
            assert (runtime.linear_memories is not None) is counted
            assert runtime.config.freeze_heap         # the server's objects out of GC's reach
        finally:
            runtime.close()
    with pytest.raises(ConfigError, match="count_linear_memory"):
        parse_config({"server": {"count_linear_memory": "yes"}, "tenants": tenants})


def test_server_memory_pool_mb_reaches_the_counted_memories() -> None:
    from host.server.setup import build_runtime
    from tests.host.fake_engine import FakeEngine

    tenants = [{"name": "a", "token": "t"}]
    config = parse_config({"server": {"memory_pool_mb": 0, "memory_pool_idle_s": 30.0},
                           "tenants": tenants})
    runtime = build_runtime(config, FakeEngine(num_pages=16, page_size=4))
    try:
        pool = runtime.linear_memories.pool
        assert not pool.put(type("Memory", (), {"capacity": 1, "num_mapped": 2, "num_bytes": 1}))
        assert pool.idle_s == 30.0
    finally:
        runtime.close()
    with pytest.raises(ConfigError, match="memory_pool_mb"):
        parse_config({"server": {"memory_pool_mb": -1}, "tenants": tenants})
    with pytest.raises(ConfigError, match="memory_pool_idle_s"):
        parse_config({"server": {"memory_pool_idle_s": 0}, "tenants": tenants})


def test_server_start_slots_reach_the_start_gate() -> None:
    from host.server.setup import build_runtime
    from tests.host.fake_engine import FakeEngine

    tenants = [{"name": "a", "token": "t"}]
    for slots, expected in ((3, 3), (0, None)):
        runtime = build_runtime(parse_config({"server": {"start_slots": slots},
                                              "tenants": tenants}), FakeEngine())
        try:
            gate = runtime.services.guests.start_gate
            assert (gate and gate.num_slots) == expected
        finally:
            runtime.close()
    with pytest.raises(ConfigError, match="start_slots"):
        parse_config({"server": {"start_slots": -2}, "tenants": tenants})


def test_the_engine_section_reaches_the_loaded_engine() -> None:
    config = parse_config({"tenants": [TENANT], "engine": {
        "num_pages": 48, "page_size": 8, "max_pass_tokens": 100, "kv_dtype": "float32"}})
    engine = load_engine_for(config)
    assert (engine.num_pages, engine.page_size, engine.max_pass_tokens) == (48, 8, 100)
    assert engine.kv_cache.dtype == torch.float32


def test_scheduler_overlap_is_the_engines_choice_unless_set() -> None:
    from host.server.setup import build_runtime
    from tests.host.fake_engine import FakeEngine

    for scheduler, overlap in (({}, False), ({"overlap": True}, True), ({"overlap": False}, False)):
        config = parse_config({"tenants": [TENANT], "scheduler": scheduler})
        runtime = build_runtime(config, FakeEngine(num_pages=16, page_size=4))
        try:
            assert runtime.scheduler.policy.overlap is overlap
        finally:
            runtime.close()


@pytest.mark.parametrize("key, value, expected", [
    ("start_hold_ms", None, 500.0), ("start_hold_ms", 50, 50.0), ("start_hold_ms", 0, 0.0),
    ("chain_steps", None, 64), ("chain_steps", 1, 1), ("chain_steps", 8, 8)])   # unset: a CPU's
def test_scheduler_settings_reach_the_runtime(key: str, value, expected) -> None:
    from host.server.setup import build_runtime
    from tests.host.fake_engine import FakeEngine

    scheduler = {} if value is None else {key: value}
    config = parse_config({"tenants": [TENANT], "scheduler": scheduler})
    runtime = build_runtime(config, FakeEngine(num_pages=16, page_size=4))
    try:
        assert getattr(runtime.scheduler.policy, key) == expected
    finally:
        runtime.close()


def test_build_runtime_gives_inferlets_the_served_name() -> None:
    """What `pie serve` passes (the served name) is what an inferlet's model-info says."""
    from host.server.setup import build_runtime
    from tests.host.fake_engine import FakeEngine

    runtime = build_runtime(parse_config({"tenants": [TENANT]}),
                            FakeEngine(num_pages=16, page_size=4), "SmolLM2-135M-Instruct")
    try:
        assert runtime.services.model_info.name == "SmolLM2-135M-Instruct"
    finally:
        runtime.close()


def test_a_tenant_s_outbound_section_reaches_its_instances_limits() -> None:
    from host.server.tenants import TenantRegistry
    config = parse_config({"tenants": [
        {**TENANT, "outbound": {"allow_hosts": ["api.example.com", "127.0.0.1:8080"],
                                "requests_per_minute": 30,
                                "mcp_servers": [{"name": "calc", "command": ["python", "c.py"]}]}},
        {"name": "b", "token": "u"}]})
    alice, bob = TenantRegistry(config.tenants).all()
    assert alice.outbound.allow_hosts == ("api.example.com", "127.0.0.1:8080")
    assert alice.outbound.requests_per_minute == 30
    assert alice.outbound.mcp_servers[0].command == ("python", "c.py")
    assert bob.outbound.allow_hosts == () and bob.outbound.mcp_servers == ()   # nothing by default

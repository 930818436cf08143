"""The real model (SmolLM2-135M, float32: batch-invariant) on two replicas: generations equal
one-process ones on either replica; an export copied to the other replica arrives bit-exact, and
an instance importing it there continues exactly as a local import does in one process; a
replica killed mid-generation ends only its own instance, and every page returns."""
from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import pytest
import ray

from engine import load_default_engine
from host.cluster.cluster import ClusterConfig, start_cluster, stop_cluster
from host.cluster.front import ClusterFront, replica_of
from host.cluster.placement import PlacementPolicy
from host.cluster.replica import ReplicaSpec
from host.runtime import Runtime
from host.runtime_config import InstanceLimits, RuntimeConfig
from tests.cluster.conftest import Events
from host.sandbox.programs.build import build_cached
from tests.host.components import components  # noqa: F401

REPO_DIR = Path(__file__).resolve().parents[2]

ENGINE = dict(dtype="float32", page_size=16, num_pages=48, progress=False, seed=0)
PROMPTS = ("The capital of France is", "1, 2, 3,")

pytestmark = pytest.mark.slow


PREFIX_ARGS = ["--name", "tutor", "--max-tokens", "8", "--question"]
QUESTIONS = ("What is a prime number?", "What is an even number?")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One compiled-program cache for the one-process runtime and both replicas."""
    return tmp_path_factory.mktemp("pie-model-cache")


@pytest.fixture(scope="module")
def prefix_cache_wasm() -> bytes:
    """inferlets/examples/prefix_cache.py built (cached on disk)."""
    path, _ = build_cached(REPO_DIR / "inferlets" / "examples" / "prefix_cache.py",
                           REPO_DIR / ".cache" / "test-inferlets")
    return path.read_bytes()


@pytest.fixture(scope="module")
def expected(components, cache_dir, prefix_cache_wasm):  # noqa: F811
    """What one process gives: PROMPTS' generations (generate.wat: 6 greedy tokens); and
    prefix_cache.py's answers to QUESTIONS, the second importing the first's export."""
    with Runtime(load_default_engine(**ENGINE), RuntimeConfig(cache_dir=cache_dir)) as alone:
        program = alone.load_program(components.component("generate"))
        generated = {p: alone.wait(alone.launch(program, [p]), 120).value for p in PROMPTS}
        prefix = alone.load_program(prefix_cache_wasm)
        answers = [json.loads(alone.wait(alone.launch(prefix, PREFIX_ARGS + [q]), 300).value)
                   for q in QUESTIONS]
    assert [a["imported"] for a in answers] == [False, True]
    return generated, answers


@pytest.fixture(scope="module")
def model_front(ray_cluster, cache_dir):
    runtime_config = RuntimeConfig(cache_dir=cache_dir, limits=InstanceLimits(max_idle_s=60.0))
    config = ClusterConfig(num_replicas=2, num_cpus=0, detached=False, name_prefix="model",
                           namespace="pie-test", max_restarts=1)
    handles = start_cluster(config, lambda rid: ReplicaSpec(
        rid, partial(load_default_engine, **ENGINE), runtime_config, torch_threads=1))
    front = ClusterFront(handles.directory, handles.replicas, config=runtime_config,
                         policy=PlacementPolicy(balance_abs=0, balance_rel=1.0), poll_s=0.2)
    front.handles = handles
    yield front
    front.close()
    stop_cluster(handles)


def test_generations_equal_one_process_on_either_replica(model_front, expected,
                                                         components) -> None:  # noqa: F811
    program = model_front.load_program(components.component("generate"))
    for prompt, value in expected[0].items():
        ids = [model_front.launch(program, [prompt]) for _ in range(2)]
        assert {replica_of(i)[0] for i in ids} == {"r0", "r1"}
        assert [model_front.wait(i, 120).value for i in ids] == [value, value]


def test_an_export_crosses_replicas_bit_exact(model_front, components) -> None:  # noqa: F811
    events = Events()
    exporter = model_front.launch(model_front.load_program(components.component("exporter")),
                                  ["kv", "persistent"], on_event=events)
    assert events.next(60) == ("message", "exported")
    home = replica_of(exporter)[0]
    directory = model_front.handles.directory
    deadline = time.monotonic() + 30
    while not ray.get(directory.holders.remote("default", "kv")):
        assert time.monotonic() < deadline, "the export never reached the directory"
        time.sleep(0.05)
    got = Events()        # the exporter keeps `home` busier: the importer lands on the other
    importer = model_front.launch(model_front.load_program(components.component("importer")),
                                  ["kv"], on_event=got, affinity="kv")
    away = replica_of(importer)[0]
    assert away != home and got.next(60) == ("message", "imported")
    replicas, epochs = model_front.handles.replicas, {}
    for rid in (home, away):
        epochs[rid] = ray.get(replicas[rid].ping.remote())
    original = ray.get(replicas[home].read_export.remote(epochs[home], "default", "kv"))
    mirror = ray.get(replicas[away].read_export.remote(epochs[away], "default", "kv"))
    assert original.num_pages == mirror.num_pages == 2
    assert original.data.shape == mirror.data.shape and bool((original.data == mirror.data).all())
    for instance_id in (importer, exporter):
        model_front.send(instance_id, "bye")
        assert model_front.wait(instance_id, 60).value == "done"


def busy(front, replica_id: str, echo) -> str:
    """An echo instance on `replica_id` (least-loaded placement alternates), others ended."""
    launched = []
    while not launched or replica_of(launched[-1])[0] != replica_id:
        launched.append(front.launch(echo, []))
    for instance_id in launched[:-1]:
        front.terminate(instance_id)
        front.wait(instance_id, 30)
    return launched[-1]


def test_an_import_on_another_replica_continues_as_a_local_one(model_front, expected,
                                                               prefix_cache_wasm,
                                                               components) -> None:  # noqa: F811
    answers = expected[1]
    program = model_front.load_program(prefix_cache_wasm)
    exporter = model_front.launch(program, PREFIX_ARGS + [QUESTIONS[0]])
    assert json.loads(model_front.wait(exporter, 300).value) == answers[0]
    home = replica_of(exporter)[0]
    directory = model_front.handles.directory
    deadline = time.monotonic() + 30
    while not ray.get(directory.holders.remote("default", "tutor")):
        assert time.monotonic() < deadline, "the export never reached the directory"
        time.sleep(0.05)
    holder = busy(model_front, home, model_front.load_program(components.component("echo")))
    importer = model_front.launch(program, PREFIX_ARGS + [QUESTIONS[1]], affinity="tutor")
    assert replica_of(importer)[0] != home                  # imbalanced: placed elsewhere
    assert json.loads(model_front.wait(importer, 300).value) == answers[1]   # imported: True
    assert model_front.statistics().num_import_mirrored == 2      # "kv" earlier, "tutor" now
    model_front.terminate(holder)
    model_front.wait(holder, 30)


def test_a_replica_killed_mid_generation_ends_only_its_instance(model_front, expected,
                                                                components) -> None:  # noqa: F811
    generate = model_front.load_program(components.component("generate"))
    long = model_front.load_program(components.component("bench_calls"))
    first = model_front.launch(long, ["step", "100000"])
    second = model_front.launch(long, ["step", "100000"])
    doomed, kept = (first, second) if replica_of(first)[0] == "r1" else (second, first)
    time.sleep(1.0)                                           # both mid-generation
    ray.kill(model_front.handles.replicas["r1"], no_restart=False)
    outcome = model_front.wait(doomed, 30)
    assert outcome.status == "trap" and "replica r1 is gone" in outcome.value
    with pytest.raises(TimeoutError):
        model_front.wait(kept, 0.5)                            # the other one runs on
    model_front.terminate(kept)
    assert model_front.wait(kept, 60).status == "terminated"   # it ran on until asked to end
    prompt, value = next(iter(expected[0].items()))
    survivor = model_front.launch(generate, [prompt])
    assert model_front.wait(survivor, 120).value == value
    figures = {f.replica_id: f for f in model_front.replica_figures()}
    r0 = figures["r0"]
    assert r0.stats.pages.num_free + r0.num_pages_exported == r0.stats.pages.num_pages

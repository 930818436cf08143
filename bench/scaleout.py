"""Scale-out on Ray (host/cluster): replicas of a fake engine that sleeps 20 ms per batch.

One local Ray cluster with 4 replicas; each figure uses a front over the first N of them.
Each replica batches at most `--batch-tokens` tokens per pass (a GPU's batch capacity scaled
down), so one replica cannot take 64 instances' decode steps in one batch and more replicas
give more throughput; the sleeping engine uses no CPU.
- scale_2 / scale_4: decode steps per second of 64 concurrent instances (`bench_calls step`)
  on 2 / 4 replicas over 1 replica;
- event_latency_p50_ms: an event's time from its emission on a replica to its hand-over by the
  front, over echo round trips (and the final events); pushed over the front's connections,
  and (event_latency_ray_poll_*, the baseline, same run) taken by long polls over Ray;
- local_import_hit: launches naming an export (8 exports spread over 4 replicas, 64 importers)
  placed where it lies, with the affinity hint, and without it (random ~ 1/4);
- instances_max_min: instances per replica, max over min, 64 launches without a key (least
  loaded) and with random session keys (rendezvous with bounded load);
- failover: 64 long-running instances over 4 replicas, one replica killed: instances of the
  others that did not finish well (collateral), seconds from the kill to the last final event
  of the lost ones, pages and reservations left over once all ended and the replica rejoined.

Run from the repo root: .venv/bin/python bench/scaleout.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

import ray  # noqa: E402

from host.cluster.cluster import ClusterConfig, init_ray, shutdown_ray, start_cluster, stop_cluster  # noqa: E402
from host.cluster.front import ClusterFront, replica_of  # noqa: E402
from host.cluster.replica import ReplicaSpec  # noqa: E402
from host.runtime_config import InstanceLimits, RuntimeConfig  # noqa: E402
from host.scheduling.scheduler import SchedulerPolicy  # noqa: E402
from tests.host.components import ComponentBuilder  # noqa: E402
from tests.host.fake_engine import FakeEngine  # noqa: E402

NUM_REPLICAS = 4
NUM_INSTANCES = 64
NUM_PAGES = 1024


def front_over(handles, num_replicas: int, config: RuntimeConfig,
               push_events: bool = True) -> ClusterFront:
    replicas = {rid: handles.replicas[rid] for rid in list(handles.replicas)[:num_replicas]}
    return ClusterFront(handles.directory, replicas, config=config, poll_s=0.2,
                        push_events=push_events)


def run_all(front: ClusterFront, program, args: list[str], num: int, **launch) -> float:
    """Seconds for `num` instances of `program`, launched at once (from 16 threads, as a server
    launches for many clients), to end (all must end "ok")."""
    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(lambda _: front.launch(program, args, **launch), range(num)))
    outcomes = [front.wait(i, 300) for i in ids]
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} instances did not end well: {bad[:3]}")
    return time.perf_counter() - started


def scaling(handles, config, guests, num_steps: int) -> dict:
    rates = {}
    for num_replicas in (1, 2, 4):
        with front_over(handles, num_replicas, config) as front:
            program = front.load_program(guests.component("bench_calls"))
            run_all(front, program, ["step", "4"], num_replicas)          # warm: compiled
            seconds = run_all(front, program, ["step", str(num_steps)], NUM_INSTANCES)
            rates[num_replicas] = NUM_INSTANCES * num_steps / seconds
    return {"steps_per_s": {str(n): round(r, 1) for n, r in rates.items()},
            "scale_2": round(rates[2] / rates[1], 3), "scale_4": round(rates[4] / rates[1], 3)}


def event_latency(handles, config, guests, num_messages: int, push_events: bool) -> dict:
    """Event latency p50 / p99 (ms) over echo round trips: events pushed over the front's
    connections, or (push_events False, the baseline) taken by long polls over Ray."""
    with front_over(handles, NUM_REPLICAS, config, push_events) as front:
        echo = front.load_program(guests.component("echo"))
        got: dict[str, threading.Semaphore] = {}

        def on_event(event) -> None:
            got[event.instance_id].release()

        ids = [front.launch(echo, [], on_event=on_event) for _ in range(8)]
        for instance_id in ids:
            got.setdefault(instance_id, threading.Semaphore(0))
        for _ in range(num_messages):
            for instance_id in ids:
                front.send(instance_id, "ping")
            for instance_id in ids:
                got[instance_id].acquire(timeout=30)
        for instance_id in ids:
            front.send(instance_id, "")
            front.wait(instance_id, 30)
        latencies = sorted(front.statistics().event_latencies_s)
    prefix = "event_latency" if push_events else "event_latency_ray_poll"
    return {f"{prefix}_p50_ms": round(statistics.median(latencies) * 1000, 3),
            f"{prefix}_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 3),
            f"{prefix}_num_events": len(latencies)}


def import_hits(handles, config, guests, hinted: bool, seed: int) -> float:
    """Fraction of importers placed on a replica holding the export they import."""
    with front_over(handles, NUM_REPLICAS, config) as front:
        exporter = front.load_program(guests.component("exporter"))
        importer = front.load_program(guests.component("importer"))
        tag = "h" if hinted else "r"
        names = [f"{tag}{seed}-{i}" for i in range(8)]
        exporters = [front.launch(exporter, [name, "persistent"]) for name in names]
        directory = handles.directory
        deadline = time.monotonic() + 30
        while any(not ray.get(directory.holders.remote("default", n)) for n in names):
            if time.monotonic() > deadline:
                raise RuntimeError("exports never reached the directory")
            time.sleep(0.05)
        rng = random.Random(seed)
        hits, importers = 0, []
        for index in range(NUM_INSTANCES):
            name = names[index % len(names)]
            holders = ray.get(directory.holders.remote("default", name))
            affinity = name if hinted else f"session{rng.random()}"
            instance_id = front.launch(importer, [name], affinity=affinity)
            hits += replica_of(instance_id)[0] in holders
            importers.append(instance_id)
        for instance_id in importers + exporters:
            front.send(instance_id, "bye")
            front.wait(instance_id, 60)
    return hits / NUM_INSTANCES


def spread(handles, config, guests, keyed: bool) -> float:
    with front_over(handles, NUM_REPLICAS, config) as front:
        echo = front.load_program(guests.component("echo"))
        rng = random.Random(7)
        ids = [front.launch(echo, [], affinity=f"user{rng.random()}" if keyed else None)
               for _ in range(NUM_INSTANCES)]
        counts = [sum(replica_of(i)[0] == rid for i in ids) for rid in handles.replicas]
        for instance_id in ids:
            front.send(instance_id, "")
            front.wait(instance_id, 60)
    return max(counts) / max(1, min(counts))


def failover(handles, config, guests) -> dict:
    with front_over(handles, NUM_REPLICAS, config) as front:
        program = front.load_program(guests.component("bench_calls"))
        ids = [front.launch(program, ["step", "400"]) for _ in range(NUM_INSTANCES)]
        time.sleep(1.0)
        victim = "r1"
        killed_at = time.monotonic()
        ray.kill(handles.replicas[victim], no_restart=False)
        lost = [i for i in ids if replica_of(i)[0] == victim]
        ended_at = []
        for instance_id in lost:
            front.wait(instance_id, 30)
            ended_at.append(time.monotonic())
        outcomes = {i: front.wait(i, 300) for i in ids}
        collateral = sum(1 for i, o in outcomes.items()
                         if replica_of(i)[0] != victim and o.status != "ok")
        lost_ok = all(o.status == "trap" and "replica lost" in o.value
                      for i, o in outcomes.items() if replica_of(i)[0] == victim)
        deadline = time.monotonic() + 60
        while victim not in front.loads() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        figures = front.replica_figures()
        leaked_pages = sum(f.stats.pages.num_used - f.num_pages_exported for f in figures)
        leaked_reservations = ray.get(handles.directory.num_reservations.remote())
    return {"failover_lost_instances": len(lost), "failover_collateral": collateral,
            "failover_lost_traps_name_replica": lost_ok,
            "failover_final_events_s": round(max(ended_at) - killed_at, 3),
            "failover_leaked_pages": leaked_pages,
            "failover_leaked_reservations": leaked_reservations,
            "failover_replicas_answering": len(figures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="decode steps per instance")
    parser.add_argument("--batch-tokens", type=int, default=16)
    parser.add_argument("--batch-ms", type=float, default=20.0)
    parser.add_argument("--messages", type=int, default=50, help="echo round trips per instance")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    init_ray(num_cpus=NUM_REPLICAS, include_dashboard=False, object_store_memory=100 << 20,
             log_to_driver=False, namespace="pie-bench",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_DIR), "OMP_NUM_THREADS": "1"}})
    guests = ComponentBuilder()
    with tempfile.TemporaryDirectory() as cache_dir:
        config = RuntimeConfig(cache_dir=Path(cache_dir),
                               limits=InstanceLimits(max_idle_s=60.0),
                               scheduler=SchedulerPolicy(max_batch_tokens=args.batch_tokens))
        engine = partial(FakeEngine, num_pages=NUM_PAGES, page_size=4, keep_log=False,
                         batch_delay_s=args.batch_ms / 1000)
        cluster = ClusterConfig(num_replicas=NUM_REPLICAS, num_cpus=0, detached=False,
                                name_prefix=f"bench{os.getpid()}", namespace="pie-bench")
        handles = start_cluster(cluster, lambda rid: ReplicaSpec(rid, engine, config))
        try:
            figures = scaling(handles, config, guests, args.steps)
            figures |= event_latency(handles, config, guests, args.messages, True)
            figures |= event_latency(handles, config, guests, args.messages, False)
            figures["local_import_hit"] = round(import_hits(handles, config, guests, True, 1), 3)
            figures["random_import_hit"] = round(import_hits(handles, config, guests, False, 2), 3)
            figures["instances_max_min"] = round(spread(handles, config, guests, False), 3)
            figures["instances_max_min_keyed"] = round(spread(handles, config, guests, True), 3)
            figures |= failover(handles, config, guests)
        finally:
            stop_cluster(handles)
            shutdown_ray()
    header = {"machine": platform.machine(), "cpus": os.cpu_count(), "ray": ray.__version__,
              "replicas": NUM_REPLICAS, "instances": NUM_INSTANCES, "batch_ms": args.batch_ms,
              "batch_tokens": args.batch_tokens, "steps": args.steps}
    if args.json:
        print(json.dumps({"header": header, **figures}, indent=2))
        return
    for name, value in {**header, **figures}.items():
        print(f"{name:34} {value}")


if __name__ == "__main__":
    main()

"""Hostile tenant against a real `pie serve`: host memory and a well-behaved tenant beside it.

    .venv/bin/python bench/hostile_serve.py            # real default model, float32
    .venv/bin/python bench/hostile_serve.py --json

Starts `pie serve` (a subprocess, the embedded SmolLM2-135M in float32) with two tenants. Tenant
B runs a greedy generation alone (its solo output); then tenant A runs every attack of
bench/hostile_attacks.py at once (memory and table growth, store / topic / log floods, a client
that does not read, unread client messages, uploads left open, page hoarding, a NaN sampler, a
pass over one page listed 2,048 times, a spinning guest, a WASI sleep, 10,000 spawns, a
fork bomb of child inferlets) while B generates again, over and over until the attacks are
done. Printed: the server's RSS before the attacks, its peak during them and after (every
instance ended, every page back), how each attack ended (the message it ended with), and
whether each of B's outputs equals its solo output.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import trio

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

from bench.hostile_attacks import ATTACKS, WAT_GUESTS  # noqa: E402
from host.client import connect  # noqa: E402
from host.sandbox.programs.build import build_cached  # noqa: E402

TOKENS = {"attacker": "tok-attacker", "victim": "tok-victim"}
VICTIM_TOKENS = 32


def server_config(data_dir: Path, num_pages: int, max_idle_s: float) -> str:
    """The TOML of the server: tenant A (attacker) may reserve the whole pool, B (victim)
    half of it; their guaranteed shares are equal (half each)."""
    return f"""
[server]
data_dir = "{data_dir}"
openai = false
shutdown_grace_s = 1.0

[engine]
num_pages = {num_pages}
page_size = 16
max_batch_tokens = 1024
dtype = "float32"
device = "cpu"

[limits]
memory_mb = 256
max_idle_s = {max_idle_s}

[[tenants]]
name = "attacker"
token = "{TOKENS['attacker']}"
max_instances = 32
max_kv_pages = {num_pages}

[[tenants]]
name = "victim"
token = "{TOKENS['victim']}"
max_instances = 4
max_kv_pages = {num_pages // 2}
"""


class ServeProcess:
    """`pie serve --config FILE --port 0` as a subprocess; its URL from the first line it prints."""

    def __init__(self, config_path: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.process = subprocess.Popen(
            [str(REPO_DIR / ".venv" / "bin" / "pie"), "serve", "--config", str(config_path),
             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, cwd=REPO_DIR)
        self.url = ""
        started = time.monotonic()
        for line in self.process.stdout:
            found = re.search(r"listening on (http://\S+?)[,\s]", line + " ")
            if found:
                self.url = found.group(1)
                break
        if not self.url:
            raise RuntimeError(f"pie serve exited with {self.process.wait()} before listening")
        self.startup_s = time.monotonic() - started
        threading.Thread(target=self.process.stdout.read, daemon=True).start()   # drain

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


class PeakSampler:
    """The highest RSS of the server seen every 50 ms while running."""

    def __init__(self, server: ServeProcess) -> None:
        self.server = server
        self.peak_mib = server.rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_mib = max(self.peak_mib, self.server.rss_mib())

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def build_programs() -> dict[str, bytes]:
    """Every guest's component bytes, by the name the attacks use."""
    from tests.host.components import ComponentBuilder

    builder = ComponentBuilder()
    programs = {name: builder.component(name) for name in WAT_GUESTS}
    programs["hostile"] = build_cached(REPO_DIR / "bench" / "guests" / "hostile_serve.py")[0] \
        .read_bytes()
    programs["probe"] = build_cached(REPO_DIR / "tests" / "server" / "apps" /
                                     "server_probe.py")[0].read_bytes()
    return programs


async def upload_all(url: str, token: str, programs: dict[str, bytes]) -> dict[str, str]:
    async with connect(url, token) as client:
        return {name: await client.upload(data) for name, data in programs.items()}


async def victim_generation(url: str, probe: str) -> str:
    async with connect(url, TOKENS["victim"]) as client:
        final = await (await client.launch(probe, ["generate", str(VICTIM_TOKENS)])).wait()
        return f"{final.kind}: {final.data}"


async def attack_with_victim(url: str, programs: dict[str, str], probe: str,
                             solo: str) -> tuple[dict[str, str], list[bool]]:
    """Every attack at once from tenant A; B generates again and again until they are over."""
    outcomes: dict[str, str] = {}
    victim_equal: list[bool] = []
    attacks_done = trio.Event()

    async def run_attack(name: str) -> None:
        started = time.monotonic()
        try:
            outcome = await ATTACKS[name](url, TOKENS["attacker"], programs)
        except Exception as exc:  # noqa: BLE001 -- reported as the attack's outcome
            outcome = f"client error: {exc!r}"[:200]
        outcomes[name] = f"{outcome} ({time.monotonic() - started:.1f} s)"

    async def run_victim() -> None:
        while not attacks_done.is_set() or not victim_equal:
            victim_equal.append(await victim_generation(url, probe) == solo)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_victim)
        async with trio.open_nursery() as attacks:
            for name in ATTACKS:
                attacks.start_soon(run_attack, name)
        attacks_done.set()
    return {name: outcomes[name] for name in ATTACKS}, victim_equal


def wait_until_idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        figures = {}
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                figures[name] = float(value)
        if figures["pie_instances_running"] == 0 and figures["pie_kv_pages_used"] == 0 \
                or time.monotonic() > deadline:
            return figures
        time.sleep(0.2)


def header() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("model name")), platform.machine())
    return (f"# {model}, {os.cpu_count()} cores, torch {torch.__version__}, cpu capability "
            f"{torch.backends.cpu.get_cpu_capability()}; pie serve (subprocess, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}), SmolLM2-135M float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-pages", type=int, default=512)
    parser.add_argument("--max-idle-s", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    programs = build_programs()
    with tempfile.TemporaryDirectory(prefix="pie-hostile-") as tmp:
        config_path = Path(tmp) / "pie.toml"
        config_path.write_text(server_config(Path(tmp) / "data", args.num_pages, args.max_idle_s))
        server = ServeProcess(config_path)
        try:
            figures = run(server, programs)
        finally:
            server.stop()
    figures = {"header": header(), **figures}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(figures["header"])
    print(f"server started in {figures['startup_s']:.1f} s")
    print(f"host RSS MiB: before {figures['rss_before_mib']:.0f}, peak "
          f"{figures['rss_peak_mib']:.0f}, after {figures['rss_after_mib']:.0f} "
          f"(after / before {figures['rss_after_mib'] / figures['rss_before_mib']:.2f}x)")
    print(f"after: {figures['instances_running_after']:.0f} instances running, "
          f"{figures['kv_pages_used_after']:.0f} KV pages used")
    print(f"tenant B: {figures['victim_runs']} generations beside the attacks, "
          f"{figures['victim_runs_equal_solo']} equal to its solo output "
          f"({figures['victim_solo'][:60]!r}...)")
    for name, outcome in figures["attacks"].items():
        print(f"  {name:32s} {outcome}")


def run(server: ServeProcess, programs: dict[str, bytes]) -> dict:
    """Upload, measure B alone, then the attacks beside B; the figures."""
    ids = trio.run(upload_all, server.url, TOKENS["attacker"], programs)
    probe = trio.run(upload_all, server.url, TOKENS["victim"], {"probe": programs["probe"]})
    solo = trio.run(victim_generation, server.url, probe["probe"])
    wait_until_idle(server.url)
    rss_before = server.rss_mib()
    with PeakSampler(server) as sampler:
        outcomes, victim_equal = trio.run(attack_with_victim, server.url, ids, probe["probe"],
                                          solo)
        after = wait_until_idle(server.url)
    time.sleep(1.0)
    return {"startup_s": server.startup_s, "rss_before_mib": rss_before,
            "rss_peak_mib": sampler.peak_mib, "rss_after_mib": server.rss_mib(),
            "instances_running_after": after["pie_instances_running"],
            "kv_pages_used_after": after["pie_kv_pages_used"], "victim_solo": solo,
            "victim_runs": len(victim_equal), "victim_runs_equal_solo": sum(victim_equal),
            "attacks": outcomes}


if __name__ == "__main__":
    main()

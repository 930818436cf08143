"""A generation read in bulk (the SDK's Generation.run) never makes its host decode loop pause
at the host's bound on unread outputs: with overlapped batches every pass after the first is
prepared ahead and fed its token (a paused loop's next pass is chained when the guest reads, in
a batch of its own, unfed)."""
from __future__ import annotations

from pathlib import Path

from engine.batch import ForwardBatch, ForwardResult
from host import Runtime, RuntimeConfig
from host.sandbox.programs.build import build_cached
from host.scheduling.scheduler import SchedulerPolicy
from tests.host.fake_engine import FakeEngine

REPO_DIR = Path(__file__).resolve().parents[2]
BUILD_CACHE = REPO_DIR / ".cache" / "test-inferlets"
NUM_TOKENS = 150              # past twice the most one `next` waits for (64)


class FedCounter(FakeEngine):
    """The fake engine, counting the passes whose input token was fed (ForwardBatch.fed_from)
    and those written in."""

    def __init__(self) -> None:
        super().__init__(num_pages=64, page_size=16, batch_delay_s=0.002, keep_log=False)
        self.num_fed = self.num_written = 0

    def forward(self, batch: ForwardBatch) -> list[ForwardResult]:
        fed_from = batch.fed_from or (None,) * len(batch.requests)
        self.num_fed += sum(source is not None for source in fed_from)
        self.num_written += sum(source is None for source in fed_from)
        return super().forward(batch)


def test_a_generation_read_in_bulk_keeps_its_loop_running_ahead(tmp_path: Path) -> None:
    wasm_path, _ = build_cached(REPO_DIR / "tests" / "host" / "apps" / "bulk_reader.py",
                                BUILD_CACHE)
    engine = FedCounter()
    config = RuntimeConfig(cache_dir=tmp_path, scheduler=SchedulerPolicy(overlap=True))
    with Runtime(engine, config) as runtime:
        program = runtime.load_program(wasm_path.read_bytes())
        outcome = runtime.wait(runtime.launch(program, [str(NUM_TOKENS)]), timeout=120)
        assert outcome.status == "ok" and outcome.value == str(NUM_TOKENS), outcome
        assert runtime.statistics().pages.num_used == 0
    assert engine.num_written == 1                    # the prompt's pass alone
    assert engine.num_fed == NUM_TOKENS - 1           # every other pass, fed

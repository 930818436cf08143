"""`BatchCounts`: what the scheduler has done since it started, for `statistics()`."""
from __future__ import annotations

from collections import deque

from host.scheduling.types import SchedulerStats

__all__ = ["BatchCounts"]

NUM_RECENT = 64        # batch sizes kept for recent_batch_sizes


class BatchCounts:
    """Counters of batches, passes, copies, cancellations and holds. Not thread-safe: the
    scheduler updates and reads them under its own lock."""

    def __init__(self) -> None:
        self.num_batches = self.num_failed_batches = self.num_forwards = 0
        self.num_copy_items = self.num_cancelled = 0
        self.num_holds = self.num_hold_timeouts = 0
        self._histogram: dict[int, int] = {}          # passes in a batch -> batches
        self._recent: deque[int] = deque(maxlen=NUM_RECENT)

    def record_batch(self, num_copy_items: int, num_forwards: int, failed: bool) -> None:
        """A batch ran (`num_forwards` 0: copies only, not counted as a batch)."""
        self.num_copy_items += num_copy_items
        if num_forwards:
            self.num_batches += 1
            self.num_failed_batches += failed
            self.num_forwards += num_forwards
            self._histogram[num_forwards] = self._histogram.get(num_forwards, 0) + 1
            self._recent.append(num_forwards)

    def stats(self, num_pending: int, num_queues: int) -> SchedulerStats:
        return SchedulerStats(
            num_batches=self.num_batches, num_failed_batches=self.num_failed_batches,
            num_forwards=self.num_forwards, num_copy_items=self.num_copy_items,
            num_cancelled=self.num_cancelled, num_pending=num_pending, num_queues=num_queues,
            max_batch_size=max(self._histogram, default=0),
            batch_size_histogram=tuple(sorted(self._histogram.items())),
            recent_batch_sizes=tuple(self._recent), num_holds=self.num_holds,
            num_hold_timeouts=self.num_hold_timeouts)

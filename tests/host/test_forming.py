"""host/scheduling/policy.py: when every head fits, the one-sort path takes exactly what the
heap path takes (the same items, the same charges); otherwise the heap's rule applies."""
from __future__ import annotations

import random
from collections import deque

import pytest

from host.scheduling import policy as batch_policy
from host.scheduling.policy import FairShares
from host.scheduling.items import Item, Taken
from host.scheduling.types import SchedulerPolicy
from tests.host.test_fairness import request


def _state(seed: int, max_tokens: int):
    """Queues of 1-12 owners (some in shared groups, some with 2-3 queues), each head 1-9
    tokens, some queues led by copies; and fair shares with earlier service."""
    rng = random.Random(seed)
    fair = FairShares(max_lag_tokens=max_tokens)
    queues: dict = {}
    order = 0
    for owner_index in range(rng.randint(1, 12)):
        owner = f"i{owner_index}"
        if rng.random() < 0.5:
            fair.set_group(owner, f"tenant{owner_index % 3}")
        for queue_id in range(rng.randint(1, 3)):
            queue: deque = deque()
            for _ in range(rng.randint(0, 2)):              # copies before the pass
                queue.append(Item((owner, queue_id), 1, order, None, (), None, None))
                order += 1
            for _ in range(rng.randint(1, 2)):
                num_tokens = rng.randint(1, 9)
                queue.append(Item((owner, queue_id), rng.randint(0, 2), order,
                                  request(order, num_tokens, (order,), page_size=16), (), None,
                                  None))
                order += 1
            queues[(owner, queue_id)] = queue
        fair.charge(owner, rng.randint(0, 20))
    return queues, fair


def _taken(queues, fair, policy, path):
    owners = {key[0] for key in queues}
    fair.settle(owners)
    if path == "sort":
        copies, forwards = batch_policy._take_every_head(queues, fair)
    else:
        taken = Taken(policy.max_batch_tokens, len(owners) > 1)
        copies, forwards = batch_policy._take_by_heap(queues, fair, policy, 16, taken)
    return ({id(item) for item in copies}, {id(item) for item in forwards},
            {key: [id(item) for item in queue] for key, queue in queues.items()},
            [fair.key(owner) for owner in sorted(owners)])


@pytest.mark.parametrize("seed", range(200))
def test_the_sort_takes_what_the_heap_takes_whenever_every_head_fits(seed) -> None:
    policy = SchedulerPolicy(max_batch_tokens=400, max_tokens_per_owner=30)   # <= 12 x 3 x 9
    queues, fair = _state(seed, policy.max_batch_tokens)
    assert batch_policy._every_head_fits(queues, policy, len({key[0] for key in queues}) > 1,
                                     policy.max_batch_tokens)
    twin_queues = {key: deque(queue) for key, queue in queues.items()}
    twin_fair = FairShares(policy.max_batch_tokens)
    twin_fair.__dict__.update({k: dict(v) for k, v in fair.__dict__.items()
                               if isinstance(v, dict)})
    assert _taken(queues, fair, policy, "sort") == _taken(twin_queues, twin_fair, policy, "heap")


def test_a_batch_that_does_not_fit_goes_through_the_heap(monkeypatch) -> None:
    policy = SchedulerPolicy(max_batch_tokens=8)
    queues = {(f"i{k}", 0): deque([Item((f"i{k}", 0), 1, k, request(k, 3, (k,)), (), None,
                                        None)]) for k in range(4)}
    assert not batch_policy._every_head_fits(queues, policy, True, policy.max_batch_tokens)
    called = []
    original = batch_policy._take_by_heap
    monkeypatch.setattr(batch_policy, "_take_by_heap", lambda *args: called.append(1) or
                        original(*args))
    copies, forwards = batch_policy.take_batch(queues, FairShares(8), policy, 4)
    assert called and [item.order for item in forwards] == [0, 1] and len(queues) == 2

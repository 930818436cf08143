"""A pass the block kernels run keeps torch on one thread from the forward through sampling
(torch's OpenMP workers would otherwise spin after the sampler's ops while the kernels' own
workers wait for a core), and a long pass keeps torch's threads for its GEMMs."""
from __future__ import annotations

import pytest
import torch

import engine.engine as engine_module
from engine.batch import ForwardBatch
from engine.quant import kernels
from tests.engine.test_quant_decoder import _request, mixed_gguf, quantized_engine  # noqa: F401

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_sampling_of_a_kernel_pass_runs_on_one_torch_thread(mixed_gguf, monkeypatch,  # noqa: F811
                                                             two_torch_threads) -> None:
    engine = quantized_engine(mixed_gguf, fused=True)
    seen = []
    sample_batch = engine_module.sample_batch

    def recording(*args, **kwargs):
        seen.append((torch.get_num_threads(), engine.model.planner.num_kernel_threads))
        return sample_batch(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample_batch", recording)
    short = ForwardBatch((_request(0, [1, 5, 9], 0), _request(1, [4, 4], 0)))     # 5 rows <= 8
    engine.forward(short)
    long = ForwardBatch((_request(2, list(range(1, 12)), 0),))                    # 11 rows > 8
    engine.forward(long)
    assert seen == [(1, 2), (2, None)]
    assert torch.get_num_threads() == 2 and engine.model.planner.num_kernel_threads is None


def test_the_kernels_thread_count_is_the_one_they_own(mixed_gguf,  # noqa: F811
                                                      two_torch_threads) -> None:
    """BatchPlanner.kernel_threads(): what engine.quant's C kernels run on (the C prefill
    attention asks it per call): torch's count outside a kernel pass, the stashed one inside."""
    planner = quantized_engine(mixed_gguf, fused=True).model.planner
    assert planner.kernel_threads() == 2
    with planner.kernels_own_the_threads():
        assert torch.get_num_threads() == 1 and planner.kernel_threads() == 2
    assert planner.kernel_threads() == 2

"""The C RMSNorm of the quantized decode path against torch's, and the thread hand-over of a
decode-sized pass (torch's ops on one thread, the block kernels on torch's count, restored)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.quant import QuantizedTensor
from engine.quant import kernels
from engine.quant.linear import BatchPlanner, QuantizedLinear
from tests.engine.test_quant_kernels import random_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())


@pytest.mark.parametrize("num_rows", [1, 7])
def test_add_rms_norm_matches_torch_and_adds_in_place(num_rows: int) -> None:
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 576, generator=generator) * 5
    delta = torch.randn(num_rows, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    expected_x = x + delta
    expected = F.rms_norm(expected_x, (576,), weight, 1e-5)
    norm = kernels.PreparedRmsNorm(weight, 1e-5)
    got = norm(x, delta)
    assert torch.equal(x, expected_x)                          # the residual was updated
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)   # no delta: x as is
    assert torch.equal(x, expected_x)


def test_add_rms_norm_refuses_what_it_cannot_read() -> None:
    weight = torch.ones(64)
    with pytest.raises(ValueError, match="x must be a contiguous CPU float32"):
        kernels.add_rms_norm(torch.ones(2, 64, dtype=torch.float64), None, weight, 1e-5)
    with pytest.raises(ValueError, match=r"delta must be .* of shape \(2, 64\)"):
        kernels.add_rms_norm(torch.ones(2, 64), torch.ones(1, 64), weight, 1e-5)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        kernels.add_rms_norm(torch.ones(2, 32), None, weight, 1e-5)
    norm = kernels.PreparedRmsNorm(weight, 1e-5)
    with pytest.raises(ValueError, match="x must be a contiguous"):
        norm(torch.ones(64, 2).T)                              # not contiguous: checked path


def test_a_decode_sized_pass_gives_the_threads_to_the_kernels() -> None:
    planner = BatchPlanner(fixed_block_rows=16)
    blocks = random_blocks(Q.Q4_1, 64, 256, seed=3)
    layer = QuantizedLinear(QuantizedTensor(torch.from_numpy(blocks), Q.Q4_1, 256), planner)
    assert planner.max_block_rows() == 16
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        with planner.kernels_own_the_threads():
            seen.append((torch.get_num_threads(), planner.num_kernel_threads))
            layer(torch.randn(1, 256))
        assert seen == [(1, 2)]
        assert torch.get_num_threads() == 2 and planner.num_kernel_threads is None
        with pytest.raises(RuntimeError, match="boom"):
            with planner.kernels_own_the_threads():
                raise RuntimeError("boom")
        assert torch.get_num_threads() == 2 and planner.num_kernel_threads is None
    finally:
        torch.set_num_threads(before)


def test_threads_for_is_reentrant_and_leaves_long_passes_alone() -> None:
    planner = BatchPlanner(fixed_block_rows=16)
    blocks = random_blocks(Q.Q4_1, 64, 256, seed=4)
    QuantizedLinear(QuantizedTensor(torch.from_numpy(blocks), Q.Q4_1, 256), planner)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with planner.threads_for(16):
            with planner.threads_for(3):                 # nested: the outer split holds
                inner = (torch.get_num_threads(), planner.num_kernel_threads)
            after_inner = (torch.get_num_threads(), planner.num_kernel_threads)
        assert inner == (1, 2) and after_inner == (1, 2)
        assert torch.get_num_threads() == 2 and planner.num_kernel_threads is None
        with planner.threads_for(17):                    # longer than any block kernel takes
            assert (torch.get_num_threads(), planner.num_kernel_threads) == (2, None)
    finally:
        torch.set_num_threads(before)

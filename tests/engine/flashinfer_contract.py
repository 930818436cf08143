"""What flashinfer 0.7.2.post1 requires of each recorded call (tests/engine/flashinfer_recording.py).

Sources, per requirement: the docstrings of BatchPrefillWithPagedKVCacheWrapper / BatchDecode...
(__init__, plan, run) and of sampling.top_k_top_p_sampling_from_probs; where a docstring is silent,
the C++ the wheel ships (flashinfer/data/csrc: CHECK_INPUT = CUDA + contiguous; the sampler reads
top_k as `int*` and top_p as `float*`, 1-D of the batch size). Values are compared where tensors
hold values (CPU runs); on the meta device only dtype, shape and device are checked.
"""
from __future__ import annotations

import types

import torch

from engine.page_table import PageTable
from tests.engine.flashinfer_recording import DECODE, PREFILL, SAMPLING, Call

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _int32_1d(value: object, expected: torch.Tensor, device: torch.device, what: str) -> None:
    """An int32 1-D tensor on `device`, of `expected`'s length (and values, when not meta)."""
    assert isinstance(value, torch.Tensor), f"{what}: a tensor, got {type(value).__name__}"
    assert value.dtype == torch.int32, f"{what}: int32, got {value.dtype}"
    assert value.shape == expected.shape, f"{what}: shape {tuple(expected.shape)}, got {tuple(value.shape)}"
    assert value.device == device, f"{what}: on {device}, got {value.device}"
    if value.device.type != "meta":
        assert torch.equal(value.cpu(), expected.to(torch.int32)), f"{what}: wrong values"


def check_wrapper_init(call: Call, device: torch.device, workspace_bytes: int) -> None:
    """float_workspace_buffer: uint8 on the inputs' device, 16-byte aligned; NHD; no CUDA graph."""
    workspace = call.arguments["float_workspace_buffer"]
    assert workspace.dtype == torch.uint8 and workspace.shape == (workspace_bytes,)
    assert workspace.device == device and workspace.data_ptr() % 16 == 0
    assert call.arguments["kv_layout"] == "NHD"
    assert call.arguments["use_cuda_graph"] is False and call.arguments["backend"] == "auto"


def check_plan(call: Call, table: PageTable, device: torch.device, heads: tuple[int, int, int],
               dtypes: tuple[torch.dtype, torch.dtype], real: types.ModuleType) -> None:
    """Plan arguments of either wrapper against the batch's page table.

    indptrs / last_page_len: int32 [B+1] / [B], on the host when the batch has no mask (plan reads
    them there), on the device with a mask (the mask's offsets are computed next to them);
    page indices: int32 [kv_indptr[-1]] on the device; head counts and page size as ints.
    """
    args = call.arguments
    decode = call.name == f"{DECODE}.plan"
    num_qo_heads, num_kv_heads, head_dim = heads
    index_device = torch.device("cpu") if table.custom_mask is None else device
    names = (("indptr", "indices", "last_page_len") if decode else
             ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
    _int32_1d(args[names[0]], table.kv_indptr, index_device, names[0])
    _int32_1d(args[names[1]], table.kv_page_indices, device, names[1])
    _int32_1d(args[names[2]], table.kv_last_page_len, index_device, names[2])
    head_dim_name = "head_dim" if decode else "head_dim_qk"
    got = (args["num_qo_heads"], args["num_kv_heads"], args[head_dim_name], args["page_size"])
    assert got == (num_qo_heads, num_kv_heads, head_dim, table.page_size)
    assert all(type(value) is int for value in got)
    assert num_qo_heads % num_kv_heads == 0
    assert args["pos_encoding_mode"] == "NONE" and args["window_left"] == -1
    assert (args["q_data_type"], args["kv_data_type"]) == dtypes and dtypes[0] in HALF_DTYPES
    assert args["o_data_type"] is None and args["sm_scale"] is None   # q's dtype, 1/sqrt(head_dim)
    if index_device.type == "cpu":           # FlashInfer's own host helper gives the table's lengths
        kv_lens = real.page.get_seq_lens(args[names[0]], args[names[2]], table.page_size)
        assert torch.equal(kv_lens.long(), table.kv_lens.long())
    if decode:
        assert bool((table.q_lens() == 1).all()) and table.custom_mask is None
        assert args["q_len_per_req"] == 1
    else:
        _check_prefill_mask(args, table, device, real)


def _check_prefill_mask(args: dict, table: PageTable, device: torch.device,
                        real: types.ModuleType) -> None:
    """qo_indptr int32 [B+1]; custom_mask bool [sum(q_len*kv_len)] on the device, or causal."""
    index_device = torch.device("cpu") if table.custom_mask is None else device
    _int32_1d(args["qo_indptr"], table.qo_indptr, index_device, "qo_indptr")
    assert args["packed_custom_mask"] is None and args["head_dim_vo"] is None
    mask = args["custom_mask"]
    if table.custom_mask is None:
        assert mask is None and args["causal"] is True
        return
    assert args["causal"] is False            # ignored with a mask; kept honest anyway
    assert mask.dtype == torch.bool and mask.dim() == 1 and mask.device == device
    assert mask.shape == table.custom_mask.shape
    if device.type != "meta":
        assert torch.equal(mask.cpu(), table.custom_mask)
        # FlashInfer's own mask offsets for these index tensors cover the mask exactly
        offsets = real.prefill._compute_page_mask_indptr(
            args["qo_indptr"].cpu(), args["paged_kv_indptr"].cpu(),
            args["paged_kv_last_page_len"].cpu(), table.page_size)
        assert torch.equal(offsets.long(), table.mask_indptr.long())
        assert int(offsets[-1]) == len(mask)


def check_run(call: Call, plan: Call, table: PageTable, device: torch.device,
              num_pages: int) -> None:
    """q [qo_indptr[-1] (decode: B), num_qo_heads, head_dim] and the 5-D NHD cache
    [num_pages, 2, page_size, num_kv_heads, head_dim], in the planned dtypes, contiguous, on the
    device; no extra positional arguments, no lse."""
    args, planned = call.arguments, plan.arguments
    decode = call.name == f"{DECODE}.run"
    head_dim = planned["head_dim" if decode else "head_dim_qk"]
    q, cache = args["q"], args["paged_kv_cache"]
    num_rows = table.num_requests if decode else table.num_tokens
    assert q.shape == (num_rows, planned["num_qo_heads"], head_dim)
    assert q.dtype == planned["q_data_type"] and q.device == device and q.is_contiguous()
    assert isinstance(cache, torch.Tensor), "the single-tensor cache form"
    assert cache.shape == (num_pages, 2, table.page_size, planned["num_kv_heads"], head_dim)
    assert cache.dtype == planned["kv_data_type"] and cache.device == device
    assert cache.is_contiguous()
    assert int(table.kv_page_indices.max()) < num_pages
    assert args["args"] == () and args["return_lse"] is False and args["out"] is None


def check_attention_calls(calls: list[Call], table: PageTable, device: torch.device,
                          heads: tuple[int, int, int], dtypes: tuple[torch.dtype, torch.dtype],
                          num_pages: int, num_layers: int, workspace_bytes: int,
                          real: types.ModuleType) -> str:
    """Both wrappers built once, one plan on the right wrapper, one run per layer; every call's
    arguments as checked above. Returns the wrapper used (PREFILL or DECODE)."""
    names = [call.name for call in calls]
    assert names[:2] == [f"{PREFILL}.__init__", f"{DECODE}.__init__"]
    for init in calls[:2]:
        check_wrapper_init(init, device, workspace_bytes)
    wrapper = DECODE if calls[2].name == f"{DECODE}.plan" else PREFILL
    assert names[2:] == [f"{wrapper}.plan"] + [f"{wrapper}.run"] * num_layers
    check_plan(calls[2], table, device, heads, dtypes, real)
    for run in calls[3:]:
        check_run(run, calls[2], table, device, num_pages)
    return wrapper


def check_sampling_call(call: Call, num_rows: int, vocab: int, device: torch.device) -> None:
    """probs float32 [R, vocab] contiguous rows of probabilities; top_k int32 [R] in 1..vocab;
    top_p float32 [R] in (0, 1]; top-k first; this sampler's generator, on the probs' device."""
    args = call.arguments
    assert call.name == SAMPLING
    probs, top_k, top_p = args["probs"], args["top_k"], args["top_p"]
    assert probs.dtype == torch.float32 and probs.shape == (num_rows, vocab)
    assert probs.is_contiguous() and probs.device == device
    torch.testing.assert_close(probs.sum(-1), torch.ones(num_rows, device=device))
    assert top_k.dtype == torch.int32 and top_k.shape == (num_rows,) and top_k.device == device
    assert bool(((top_k >= 1) & (top_k <= vocab)).all())
    assert top_p.dtype == torch.float32 and top_p.shape == (num_rows,) and top_p.device == device
    assert bool(((top_p > 0) & (top_p <= 1)).all())
    assert args["filter_apply_order"] == "top_k_first" and args["indices"] is None
    generator = args["generator"]
    assert isinstance(generator, torch.Generator) and generator.device == device
    assert args["seed"] is None and args["offset"] is None and args["return_valid"] is False

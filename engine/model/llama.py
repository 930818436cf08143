"""Llama-family forward pass over a ragged batch (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings).

Weights come in Hugging Face naming (model.layers.{i}.self_attn.q_proj.weight, ...). At build time
Q/K/V are fused into one [ (Hq + 2 Hkv) * D, hidden ] matrix and gate/up into one
[2 * intermediate, hidden] matrix, so a layer is 4 matmuls (each an engine.model.linear.Linear:
oneDNN-packed bf16, plus an int4 copy for small batches when the weights are a Q4 GGUF's; or, in
"quantized" mode, GGUF blocks multiplied in place by engine.quant's C kernels, float32 activations).
The residual stream and the RMSNorms are float32 whatever the weight dtype, except with FlashInfer's
fused kernels (`kernels`, the CUDA path: engine/model/flashinfer_kernels.py), where the residual is
in the model dtype. Logits are computed only at the output rows of the batch; `decode_greedy` is
the one-token-per-row step the CUDA graphs capture (engine/cuda_graphs.py). A pass with LoRA
adapters (`lora`, engine.adapters) adds each row's low-rank delta after every base projection:
in the fused C decoder when it takes the pass, else layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.adapters.apply import LoraPass
from engine.engine_config import ModelConfig
from engine.kv_cache import KVCache
from engine.model.flashinfer_kernels import FlashInferKernels
from engine.model.linear import PartsLinear, make_linear
from engine.quant import QuantizedTensor
from engine.quant import kernels as quant_kernels
from engine.quant.decoder import MAX_PARTS, DecoderShape, FusedDecoder, FusedLayer
from engine.quant.linear import BatchPlanner, QuantizedLinear
from engine.model.memory import release_freed_memory
from engine.model.rope import apply_rope, rope_tables
from engine.page_table import PageTable

__all__ = ["LlamaModel", "LayerWeights"]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, fused for fewer matmuls."""

    input_norm: torch.Tensor     # [hidden] float32 (norms run on the float32 residual stream)
    qkv_proj: Callable           # [(Hq + 2 Hkv) * D, hidden]  (see engine.model.linear)
    o_proj: Callable             # [hidden, Hq * D]
    post_norm: torch.Tensor      # [hidden] float32
    gate_up_proj: Callable       # [2 * intermediate, hidden]
    down_proj: Callable          # [hidden, intermediate]


Weight = torch.Tensor | QuantizedTensor


def _take(weights: dict[str, Weight], name: str, shape: tuple[int, ...]) -> Weight:
    """Pop one weight, checking its shape (so a wrong file fails here with its name)."""
    if name not in weights:
        raise ValueError(f"weight {name} is missing")
    tensor = weights.pop(name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _on(weight: Weight, device: torch.device, dtype: torch.dtype) -> Weight:
    """A dense weight moved and cast; blocks stay as they are (CPU only)."""
    if isinstance(weight, QuantizedTensor):
        if device.type != "cpu":
            raise ValueError(f"quantized weights run on the CPU only, not {device}")
        return weight
    return weight.to(device=device, dtype=dtype)


def _layer_weights(config: ModelConfig, weights: dict[str, Weight], i: int, dtype: torch.dtype,
                   device: torch.device, allow_int4: bool,
                   planner: BatchPlanner | None) -> LayerWeights:
    hidden, d = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_heads * d, config.num_kv_heads * d
    prefix = f"model.layers.{i}."

    def take(name: str, shape: tuple[int, ...]) -> Weight:
        return _on(_take(weights, prefix + name, shape), device, dtype)

    def linear(*parts: Weight) -> Callable:
        return make_linear(list(parts), allow_int4, planner)

    return LayerWeights(
        input_norm=take("input_layernorm.weight", (hidden,)).float(),
        qkv_proj=linear(take("self_attn.q_proj.weight", (q_dim, hidden)),
                        take("self_attn.k_proj.weight", (kv_dim, hidden)),
                        take("self_attn.v_proj.weight", (kv_dim, hidden))),
        o_proj=linear(take("self_attn.o_proj.weight", (hidden, q_dim))),
        post_norm=take("post_attention_layernorm.weight", (hidden,)).float(),
        gate_up_proj=linear(take("mlp.gate_proj.weight", (config.intermediate_size, hidden)),
                            take("mlp.up_proj.weight", (config.intermediate_size, hidden))),
        down_proj=linear(take("mlp.down_proj.weight", (hidden, config.intermediate_size))),
    )


def _add_norm(weight: torch.Tensor, eps: float,
              on_c: bool) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """norm(x, delta): x += delta in place (x is a pass's own float32 residual stream), then
    RMSNorm(x) * weight, [N, hidden] float32. `on_c` (quantized mode): one C call instead of
    torch's ~6 ops; otherwise torch's rms_norm, bit for bit."""
    if on_c:
        return quant_kernels.PreparedRmsNorm(weight, eps)

    def add_norm(x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        if delta is not None:
            x.add_(delta)
        return F.rms_norm(x, (weight.shape[0],), weight, eps)
    return add_norm


def _block_parts(projection: Callable) -> tuple[QuantizedLinear, ...] | None:
    """The block linears a projection is made of, or None when some part is dense."""
    if isinstance(projection, QuantizedLinear):
        return (projection,)
    if (isinstance(projection, PartsLinear) and len(projection.parts) <= MAX_PARTS
            and all(isinstance(part, QuantizedLinear) for part in projection.parts)):
        return tuple(projection.parts)
    return None


def _fused_decoder(config: ModelConfig, layers: list[LayerWeights],
                   planner: BatchPlanner) -> FusedDecoder | None:
    """The C decoder over these layers when the extension is built and every projection is
    GGUF blocks (else None: the per-layer path runs every pass); its activation width per
    projection and row count is the planner's, as on the per-layer path."""
    if not quant_kernels.available():
        return None
    fused, max_rows = [], None
    for layer in layers:
        projections = [_block_parts(p) for p in (layer.qkv_proj, layer.o_proj,
                                                  layer.gate_up_proj, layer.down_proj)]
        if any(parts is None for parts in projections):
            return None
        limit = min(part.block_rows_limit for parts in projections for part in parts)
        max_rows = limit if max_rows is None else min(max_rows, limit)
        fused.append(FusedLayer(layer.input_norm.contiguous(), layer.post_norm.contiguous(),
                                tuple(tuple(part.weight for part in parts)
                                      for parts in projections)))
    shape = DecoderShape(config.hidden_size, config.intermediate_size, config.num_heads,
                         config.num_kv_heads, config.head_dim, config.rms_norm_eps)
    return FusedDecoder(shape, fused, max_rows or 0, act8_min_rows=planner.act8_min_rows)


class LlamaModel:
    """The model's weights and its batched forward pass. Consumes the `weights` dict it is given.

    allow_int4: keep 4-bit-grid weights also packed for the int4 kernel (bf16 on the CPU only; see
    engine/model/linear.py); float32 never does. Weights given as QuantizedTensor (GGUF blocks)
    run on the C kernels with float32 activations (`dtype` must then be float32); `planner`
    (made here when None, with 8-bit activation blocks allowed unless `act8` is False) picks
    block kernel or dequantize + GEMM, and the activations' width, per batch size.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Weight],
                 dtype: torch.dtype, device: str | torch.device = "cpu",
                 allow_int4: bool = True, planner: BatchPlanner | None = None,
                 kernels: FlashInferKernels | None = None, act8: bool = True) -> None:
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.planner = planner
        if any(isinstance(w, QuantizedTensor) for w in weights.values()):
            if dtype != torch.float32:
                raise ValueError(f"quantized weights take float32 activations, not {dtype}")
            self.planner = planner or BatchPlanner(act8=act8)
        vocab_shape = (config.vocab_size, config.hidden_size)
        self.embed = _on(_take(weights, "model.embed_tokens.weight", vocab_shape), device, dtype)
        self.layers = []
        for i in range(config.num_layers):
            self.layers.append(_layer_weights(config, weights, i, dtype, device, allow_int4,
                                              self.planner))
            release_freed_memory()        # the layer's unpacked weights are gone: keep RSS flat
        self.final_norm = _take(weights, "model.norm.weight", (config.hidden_size,)).to(device).float()
        if "lm_head.weight" in weights:
            lm_head = _on(_take(weights, "lm_head.weight", vocab_shape), device, dtype)
        elif config.tie_word_embeddings:
            lm_head = self.embed
        else:
            raise ValueError("weight lm_head.weight is missing and the embeddings are not tied")
        self.lm_head = make_linear([lm_head], allow_int4, self.planner)   # [vocab, hidden]
        if lm_head is self.embed and isinstance(getattr(self.lm_head, "weight", None),
                                                QuantizedTensor):
            self.embed = self.lm_head.weight     # tied and relaid out: one copy serves both
        self.rope_cos, self.rope_signed_sin = rope_tables(config, dtype)  # [max_position, D]
        self.rope_cos = self.rope_cos.to(device)
        self.rope_signed_sin = self.rope_signed_sin.to(device)
        self.q_dim = config.num_heads * config.head_dim
        self.kv_dim = config.num_kv_heads * config.head_dim
        # per layer (input, post-attention) norms, then the final one: x += delta, RMSNorm(x)
        on_c = self.planner is not None and quant_kernels.available()
        self.norms = [(_add_norm(layer.input_norm, config.rms_norm_eps, on_c),
                       _add_norm(layer.post_norm, config.rms_norm_eps, on_c))
                      for layer in self.layers]
        self.final_add_norm = _add_norm(self.final_norm, config.rms_norm_eps, on_c)
        self.fused_decoder = _fused_decoder(config, self.layers, self.planner) if self.planner else None
        # FlashInfer's fused kernels (CUDA): residual and norm weights in the model dtype
        self.kernels = kernels
        self.kernel_norms = None if kernels is None else [
            (layer.input_norm.to(dtype), layer.post_norm.to(dtype)) for layer in self.layers]
        self.kernel_final_norm = None if kernels is None else self.final_norm.to(dtype)

    def forward(self, table: PageTable, kv_cache: KVCache, attention,
                lora: LoraPass | None = None) -> torch.Tensor:
        """Run the batch, write its K/V into the pool, return float32 logits [num_outputs, vocab].

        `attention` must already be planned for `table`; `lora`: the adapter deltas of the
        table's rows, or None. In quantized mode a pass short enough for some block kernel gives
        the threads to them (BatchPlanner.threads_for).
        """
        if self.planner is None:
            return self._forward(table, kv_cache, attention, lora)
        with self.planner.threads_for(table.num_tokens):
            return self._forward(table, kv_cache, attention, lora)

    @torch.inference_mode()
    def _forward(self, table: PageTable, kv_cache: KVCache, attention,
                 lora: LoraPass | None) -> torch.Tensor:
        device = self.rope_cos.device              # the table is on the CPU; no-op there
        positions = table.positions.to(device)
        x = self._embed(table.input_ids.to(device))                       # [N, hidden]
        if self.kernels is not None:
            x, delta = self._kernel_layers(x, positions, kv_cache, attention, lora)
            return self._logits(x, table, delta)
        if self._run_fused(x, table, kv_cache, attention, positions, lora):
            return self._logits(x, table, None)
        x, delta = self._torch_layers(x, positions, kv_cache, attention, lora)
        return self._logits(x, table, delta)

    @torch.inference_mode()
    def decode_greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                      attention, out: torch.Tensor) -> None:
        """One new token per row: out [R] int64 = argmax of the float32 logits of each row.

        input_ids, positions [R] on the model's device; `attention` planned for these R rows.
        Reads nothing on the host and allocates only intermediates, so it can be captured in a
        CUDA graph over fixed buffers (engine.cuda_graphs)."""
        x = self._embed(input_ids)                                        # [R, hidden]
        if self.kernels is not None:
            x, delta = self._kernel_layers(x, positions, kv_cache, attention)
            h = self.kernels.add_norm(x, delta, self.kernel_final_norm)
        else:
            x, delta = self._torch_layers(x, positions, kv_cache, attention)
            h = self.final_add_norm(x, delta)
        logits = self.lm_head(h.to(self.dtype)).float()                  # [R, vocab]
        torch.argmax(logits, dim=-1, out=out)

    def _torch_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                      attention, lora: LoraPass | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer in torch ops over the float32 residual x [N, hidden] -> (x, the last
        sublayer's output still to be added). `lora`: adapter deltas added after each
        projection (LoraPass.add: fused projection 0 qkv, 1 o, 2 gate_up, 3 down)."""
        config = self.config
        n, d = x.shape[0], config.head_dim
        num_qk_heads = config.num_heads + config.num_kv_heads
        cos = self.rope_cos[positions].unsqueeze(1)                       # [N, 1, D]
        signed_sin = self.rope_signed_sin[positions].unsqueeze(1)
        dtype = self.dtype
        # the residual stream stays float32 (cheaper norms in bf16 mode, closer to exact);
        # matmul inputs are cast to the weights' dtype (a no-op in float32 mode)
        delta = None           # the last sublayer's output, added to x by the next norm
        for i, (layer, (input_norm, post_norm)) in enumerate(zip(self.layers, self.norms)):
            h = input_norm(x, delta).to(dtype)                            # x += delta
            qkv = layer.qkv_proj(h)                            # [N, (Hq + 2 Hkv) * D]
            if lora is not None:
                lora.add(i, 0, h, qkv)
            qk = apply_rope(qkv[:, :self.q_dim + self.kv_dim].view(n, num_qk_heads, d), cos,
                            signed_sin)
            q, k = qk[:, :config.num_heads], qk[:, config.num_heads:]     # [N, Hq|Hkv, D]
            v = qkv[:, self.q_dim + self.kv_dim:].view(n, config.num_kv_heads, d)
            kv_layer = kv_cache.layer(i)
            attention.append_kv(kv_layer, k, v)
            attn = attention.run(q, kv_layer).reshape(n, self.q_dim)      # [N, Hq * D]
            delta = layer.o_proj(attn)                                    # [N, hidden]
            if lora is not None:
                lora.add(i, 1, attn, delta)
            h = post_norm(x, delta).to(dtype)
            gate_up = layer.gate_up_proj(h)                               # [N, 2 * intermediate]
            if lora is not None:
                lora.add(i, 2, h, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)                           # [N, intermediate] each
            act = F.silu(gate) * up
            delta = layer.down_proj(act)
            if lora is not None:
                lora.add(i, 3, act, delta)
        return x, delta

    def _kernel_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                       attention, lora: LoraPass | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer with FlashInfer's fused kernels (engine.model.flashinfer_kernels) over
        the residual x [N, hidden] in the model dtype -> (x, the last sublayer's output);
        `lora` as in _torch_layers."""
        config, kernels = self.config, self.kernels
        n, d = x.shape[0], config.head_dim
        q_end, k_end = self.q_dim, self.q_dim + self.kv_dim
        delta = None
        for i, (layer, (input_norm, post_norm)) in enumerate(zip(self.layers, self.kernel_norms)):
            h = kernels.add_norm(x, delta, input_norm)                    # x += delta
            qkv = layer.qkv_proj(h)                                       # [N, (Hq + 2 Hkv) * D]
            if lora is not None:
                lora.add(i, 0, h, qkv)
            q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
            kernels.rope_(positions, q, k)                                # in place, in qkv
            kv_layer = kv_cache.layer(i)
            attention.append_kv(kv_layer, k.view(n, config.num_kv_heads, d),
                                v.view(n, config.num_kv_heads, d))
            attn = attention.run(q.view(n, config.num_heads, d), kv_layer).reshape(n, self.q_dim)
            delta = layer.o_proj(attn)                                    # [N, hidden]
            if lora is not None:
                lora.add(i, 1, attn, delta)
            h = kernels.add_norm(x, delta, post_norm)
            gate_up = layer.gate_up_proj(h)                               # [N, 2 * intermediate]
            if lora is not None:
                lora.add(i, 2, h, gate_up)
            act = kernels.silu_and_mul(gate_up)                           # [N, intermediate]
            delta = layer.down_proj(act)
            if lora is not None:
                lora.add(i, 3, act, delta)
        return x, delta

    def _logits(self, x: torch.Tensor, table: PageTable, delta: torch.Tensor | None) -> torch.Tensor:
        """float32 logits [num_outputs, vocab] of the output rows of x (+ delta) [N, hidden]."""
        if not table.outputs_are_all_rows:
            rows = table.output_rows.to(x.device)
            x, delta = x[rows], None if delta is None else delta[rows].contiguous()
        if self.kernels is not None:
            x = self.kernels.add_norm(x, delta, self.kernel_final_norm)
        else:
            x = self.final_add_norm(x, delta)
        return self.lm_head(x.to(self.dtype)).float()            # [num_outputs, vocab]

    def _run_fused(self, x: torch.Tensor, table: PageTable, kv_cache: KVCache, attention,
                   positions: torch.Tensor, lora: LoraPass | None) -> bool:
        """Run every layer in one C call, adapters' deltas included, when the attention backend
        offers the pass as token rows (decode steps, short prompts: its `decode_plan`) and the
        fused decoder takes that many (x [N, hidden] then holds the residual stream); False,
        having done nothing, otherwise."""
        fused = self.fused_decoder
        if (fused is None or table.num_tokens > fused.max_rows
                or kv_cache.dtype not in quant_kernels.KERNEL_KV_DTYPES):
            return False
        plan = attention.decode_plan(kv_cache.num_pages * 2 * kv_cache.page_size)
        if plan is None:
            return False
        fused.run(x, self.rope_cos[positions], self.rope_signed_sin[positions], kv_cache.pool,
                  plan, self.planner.num_kernel_threads or torch.get_num_threads(),
                  None if lora is None else lora.for_decoder(fused.shape, len(fused.layers)))
        return True

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> [N, hidden]: float32 (blocks: only the N rows are dequantized), or
        the model dtype on the fused-kernel path."""
        if isinstance(self.embed, QuantizedTensor):
            return quant_kernels.dequantize_rows(self.embed, input_ids)
        if self.kernels is not None:                     # the fused path's residual dtype
            return F.embedding(input_ids, self.embed)
        return F.embedding(input_ids, self.embed).float()

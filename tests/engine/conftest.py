import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint written by transformers (no tokenizer files)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_draft(tiny_llama, tmp_path_factory):
    """tiny_llama's first layer alone (its embedding, norm and head): a draft model that shares
    the target's vocabulary and often, not always, agrees with it."""
    target = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = target.config
    config.num_hidden_layers = 1
    draft = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing
    path = tmp_path_factory.mktemp("tiny") / "llama_draft"
    draft.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_bf16(tmp_path_factory):
    """Qwen3's features (q/k norms, tied embeddings) in bfloat16, as written by transformers: every
    decode step of up to 4 sequences is captured in a CPU graph."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1,
        tie_word_embeddings=True,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("qwen3") / "bf16"
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path

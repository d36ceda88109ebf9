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


HYBRIDS = {
    "dense": (transformers.Qwen3_5TextConfig, "Qwen3_5ForCausalLM", {}),
    # top-2 of 4 experts and a shared expert: the routing's choices and weights must not move either
    "moe": (transformers.Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)),
}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_hybrid_checkpoint(tmp_path_factory):
    """`make(kind, initializer_range=0.1)`: the path of a tiny random Qwen3.5 ("dense", or "moe":
    with a mixture of experts) written by transformers, three Gated DeltaNet layers then one of
    gated full attention; written once per kind and range. A small range makes a model whose
    greedy text falls into cycles (prompt lookup then predicts it)."""
    written = {}

    def make(kind: str, initializer_range: float = 0.1):
        if (kind, initializer_range) not in written:
            config_class, architecture, extra = HYBRIDS[kind]
            torch.manual_seed(0)
            config = config_class(
                vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=256,
                initializer_range=initializer_range, **extra,
            )  # fmt: skip
            config.architectures = [architecture]
            path = tmp_path_factory.mktemp("hybrid") / kind
            transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
            written[kind, initializer_range] = path
        return written[kind, initializer_range]

    return make


@pytest.fixture
def abort_odd_requests():
    """An `on_step` callback for `LLM.generate` (given the engine) that aborts every request
    with an odd id once it has 5 output tokens, mid-draft when speculating; `.aborted` holds
    their ids."""

    class AbortOdd:
        def __init__(self, engine) -> None:
            self.engine, self.aborted = engine, set()

        def __call__(self, outputs) -> None:
            for out in outputs:
                odd = int(out.request_id.split("-")[-1]) % 2
                if out.request_id not in self.aborted and len(out.outputs[0].token_ids) >= 5 and odd:
                    self.aborted.add(out.request_id)
                    self.engine.abort_request(out.request_id)

    return AbortOdd


@pytest.fixture(scope="session")
def assert_nothing_held():
    """A check that an engine holds nothing after its requests ended: no request left, every KV
    block free, and (a hybrid) every state slot and prefix-cache checkpoint, and (speculating
    with a draft model) every draft block and shadow sequence."""

    def check(llm) -> None:
        engine = llm.engine
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        slots = engine.scheduler.state_slots
        if slots is not None:
            assert slots.num_free == slots.num_slots
        checkpoints = engine.scheduler.checkpoints
        if checkpoints is not None:
            assert checkpoints.num_pending == 0
            assert checkpoints.num_free + checkpoints.num_filed == checkpoints.num_checkpoints
        proposer = engine.speculator.proposer if engine.speculator is not None else None
        draft_blocks = getattr(proposer, "blocks", None)
        if draft_blocks is not None:
            assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
            assert not proposer._shadows

    return check

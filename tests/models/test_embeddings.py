"""Embeddings (`LLM.embed`) against Hugging Face transformers on the same random weights.

A tiny random Llama and a tiny random Qwen3.5 (hybrid: DeltaNet state slots) are written with
`save_pretrained`; the reference is transformers' base model's `last_hidden_state` (the final
hidden states after the final norm), pooled by hand: the last token's, or the mean over the
prompt, L2-normalised or not. tuili runs with block_size=4 and a 7-token step budget, so that
prompts are split into chunks at odd positions (MEAN sums across chunks) and the batch mixes
prompt lengths. Also: a batch equals each prompt alone bit for bit, prefix-cache hits give the same vector
(LAST takes them, MEAN never does), embeddings and generation share steps without changing each
other's results, every block and state slot comes back after finish and abort, bad input refused
by name.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tuili import LLM, PoolingParams, SamplingParams
from tuili.errors import RequestError, TuiliError

PROMPTS = [
    [5, 17, 250, 3, 99, 100, 101, 7, 8, 9, 10, 11, 12, 13],
    [42],
    list(range(30, 53)),
    [7, 7, 7, 200, 201],
]

LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6)
QWEN35 = dict(vocab_size=320, hidden_size=48, num_hidden_layers=4, head_dim=16, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, initializer_range=0.1,
              rms_norm_eps=1e-6, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3,
              linear_num_key_heads=2, linear_num_value_heads=6)


def _config(name: str) -> transformers.PretrainedConfig:
    if name == "llama":
        return transformers.LlamaConfig(**LLAMA)
    return transformers.Qwen3_5TextConfig(**QWEN35)


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    """(path, transformers' base model) of a tiny random checkpoint, its norms randomised (a
    final norm left out would not show at its identity)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(request.param), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if ".linear_attn.norm" in name else 0.0))
    path = tmp_path_factory.mktemp("embed") / request.param
    model.save_pretrained(path)
    base = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").float().eval()
    return path, base


def _llm(path, **options) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20,
                   max_num_batched_tokens=7) | options
    return LLM(model=str(path), **options)


def _reference(base, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = base(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def _assert_same(llm: LLM, ours: list[list[float]], expected: list[list[float]]) -> None:
    """Bit for bit where the native kernels run (batch invariance: docs/engine.md), else (the
    portable torch path, whose products take their blocking from the shape) to float32 rounding."""
    if llm.engine.platform.native_kernels:
        assert ours == expected
    else:
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=2e-6, rtol=1e-5)


def _assert_all_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks
    slots = llm.engine.scheduler.state_slots
    assert slots is None or slots.num_free == slots.num_slots
    assert not llm.engine.runner._pool_sums and not llm.engine.runner._pooled


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_match_transformers(checkpoint, pooling):
    path, base = checkpoint
    llm = _llm(path)
    for normalize in (True, False):
        outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], PoolingParams(normalize=normalize),
                         pooling=pooling)
        for ids, out in zip(PROMPTS, outs, strict=True):
            assert out.finished and out.prompt_token_ids == ids
            assert out.outputs.hidden_size == base.config.hidden_size
            ours = torch.tensor(out.outputs.embedding)
            torch.testing.assert_close(ours, _reference(base, ids, pooling, normalize), atol=2e-5, rtol=1e-4)
            if normalize:
                assert abs(float(ours.norm()) - 1.0) < 1e-5
    _assert_all_free(llm)


def test_default_is_last_normalised_and_pooler_config_chooses_mean(checkpoint):
    path, base = checkpoint
    ids = PROMPTS[0]
    default = _llm(path).embed({"prompt_token_ids": ids})[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(default), _reference(base, ids, "last", True), atol=2e-5, rtol=1e-4)
    mean = _llm(path, pooler_config={"pooling_type": "MEAN", "normalize": False}).embed({"prompt_token_ids": ids})
    torch.testing.assert_close(torch.tensor(mean[0].outputs.embedding), _reference(base, ids, "mean", False),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batch_of_mixed_lengths_equals_each_alone(checkpoint, pooling):
    path, _ = checkpoint
    llm = _llm(path, enable_prefix_caching=False)
    batch = [out.outputs.embedding for out in llm.embed([{"prompt_token_ids": p} for p in PROMPTS], pooling=pooling)]
    alone = [llm.embed({"prompt_token_ids": p}, pooling=pooling)[0].outputs.embedding for p in PROMPTS]
    _assert_same(llm, batch, alone)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prefix_cache_never_changes_the_vector(checkpoint, pooling):
    path, _ = checkpoint
    llm = _llm(path)
    long_prompt = list(range(60, 100))  # 10 blocks of 4: hybrid models checkpoint state every 4 blocks
    first = llm.embed({"prompt_token_ids": long_prompt}, pooling=pooling)[0].outputs.embedding
    hits_before = llm.engine.stats().prefix_cache.hit_tokens
    second = llm.embed({"prompt_token_ids": long_prompt}, pooling=pooling)[0].outputs.embedding
    hits = llm.engine.stats().prefix_cache.hit_tokens - hits_before
    assert (hits > 0) == (pooling == "last")  # MEAN needs every position's hidden state: no hit taken
    torch.testing.assert_close(torch.tensor(second), torch.tensor(first), atol=2e-6, rtol=1e-5)
    _assert_all_free(llm)


def test_embeddings_and_generation_share_steps(checkpoint):
    """Embedding requests added while others generate: both come out as each would alone."""
    path, _ = checkpoint
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    solo = _llm(path, enable_prefix_caching=False)
    expected_tokens = [o.outputs[0].token_ids for o in solo.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)]
    expected_vectors = [solo.embed({"prompt_token_ids": p}, pooling="mean")[0].outputs.embedding for p in PROMPTS]

    llm = _llm(path, enable_prefix_caching=False)
    engine = llm.engine
    pooling = PoolingParams().resolve(engine.config.pooler_config, engine.model_config.hidden_size, "mean")
    gen_ids = [engine.add_request({"prompt_token_ids": p}, greedy) for p in PROMPTS]
    engine.step()
    engine.step()
    emb_ids = [engine.add_request({"prompt_token_ids": p}, pooling=pooling) for p in PROMPTS]
    finals = {}
    mixed = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        mixed += any(o.embedding is not None for o in outs) and any(o.outputs for o in outs)
        finals.update({o.request_id: o for o in outs if o.finished})
    assert [finals[i].outputs[0].token_ids for i in gen_ids] == expected_tokens
    _assert_same(llm, [finals[i].embedding for i in emb_ids], expected_vectors)
    assert all(finals[i].outputs == [] for i in emb_ids)
    _assert_all_free(llm)


def test_abort_mid_prompt_frees_everything(checkpoint):
    path, _ = checkpoint
    llm = _llm(path, max_num_batched_tokens=4)
    engine = llm.engine
    pooling = PoolingParams().resolve(engine.config.pooler_config, engine.model_config.hidden_size, "mean")
    request_id = engine.add_request({"prompt_token_ids": PROMPTS[2]}, pooling=pooling)
    engine.step()  # 4 of 23 tokens: a partial sum is held
    assert engine.runner._pool_sums
    engine.abort_request(request_id)
    (out,) = engine.step()
    assert out.finished and out.embedding is None
    _assert_all_free(llm)


def test_preemption_restarts_the_mean(checkpoint):
    """Two prompts of 23 tokens (6 blocks each) in two fairly shared groups, with 8 KV blocks:
    both prefill side by side until the pool runs out, then the newer is preempted mid-prompt
    and recomputed from position 0; both vectors are transformers'."""
    path, base = checkpoint
    prompts = [PROMPTS[2], list(reversed(PROMPTS[2]))]
    budget = _budget(_llm(path), blocks=8)
    llm = _llm(path, enable_prefix_caching=False, max_model_len=32, max_num_seqs=2, kv_cache_memory=budget,
               max_num_batched_tokens=8)
    engine = llm.engine
    assert engine.pool.num_blocks == 8
    pooling = PoolingParams().resolve(engine.config.pooler_config, engine.model_config.hidden_size, "mean")
    ids = [engine.add_request({"prompt_token_ids": p}, pooling=pooling, group=f"g{i}") for i, p in enumerate(prompts)]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.stats().num_preemptions > 0
    for request_id, prompt in zip(ids, prompts, strict=True):
        torch.testing.assert_close(torch.tensor(finals[request_id].embedding), _reference(base, prompt, "mean", True),
                                   atol=2e-5, rtol=1e-4)
    _assert_all_free(llm)


def _budget(llm: LLM, blocks: int) -> int:
    """Bytes for `blocks` KV blocks (and, for a hybrid model, two state slots) of `llm`'s model."""
    from tuili.engine.pool import kv_bytes_per_block, state_bytes_per_slot

    cfg = llm.engine.model.config
    state = 2 * state_bytes_per_slot(cfg, torch.float32) if cfg.is_hybrid else 0
    return blocks * kv_bytes_per_block(cfg, 4, torch.float32) + state


def test_bad_input_is_refused_by_name(checkpoint):
    path, base = checkpoint
    llm = _llm(path, max_model_len=16)
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.embed({"prompt_token_ids": []})
    with pytest.raises(RequestError, match="prompt has 17 tokens but max_model_len is 16"):
        llm.embed({"prompt_token_ids": list(range(17))})
    assert len(llm.embed({"prompt_token_ids": list(range(16))})[0].outputs.embedding) == base.config.hidden_size
    with pytest.raises(RequestError, match="dimensions=8 is not supported"):
        llm.embed({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=8))
    assert llm.embed({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=base.config.hidden_size))
    with pytest.raises(RequestError, match="pooling='cls' is not supported: expected one of last, mean"):
        llm.embed({"prompt_token_ids": [1, 2]}, pooling="cls")
    with pytest.raises(TuiliError, match=r"pooler_config key\(s\) \['pooling'\] are not supported"):
        _llm(path, pooler_config={"pooling": "mean"})
    with pytest.raises(TuiliError, match="pooler_config pooling_type='CLS' is not supported"):
        _llm(path, pooler_config={"pooling_type": "CLS"})
    _assert_all_free(llm)

"""Speculative decoding with a hybrid target (Qwen3.5: Gated DeltaNet layers beside full
attention): a verification chunk saves the linear-attention state after each of its positions,
and a rejection leaves the sequence's slot at the last accepted one (tuili/engine/runner.py);
and the checkpoint's own multi-token-prediction layers as the proposer ("mtp",
tuili/engine/spec/mtp.py), checked against transformers' Qwen3.5 decoder layer and RMSNorm.

Greedy outputs are token for token those without speculation — in float32, with preemption and
prefix-cache hits (state checkpoints) in the mix, and in bf16 on the native CPU path, whose
DeltaNet kernels compute token by token (tests/engine/test_batch_invariance.py) — and nothing
is held after many rejections and aborts. Proposers: prompt lookup, the target quantized to int4
as its own (hybrid) draft, whose state rewinds to where its text agrees with the target's, and
MTP. The models are tiny random Qwen3.5s whose greedy text falls into cycles (small initial
weights), so prompt lookup both hits and misses."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tuili import LLM, SamplingParams
from tuili.errors import TuiliError

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7],
    [1, 2, 3, 4] * 6 + [1, 2],
    list(range(40, 80)),
    [100 + (i * 37) % 150 for i in range(30)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
INIT = 0.02  # the checkpoints' initializer_range: greedy text with cycles
SMALL = 16 << 20  # a KV budget the tiny models fill quickly (the CPU default, 2 GiB, takes seconds to allocate)

# float32 sizes of the tiny Qwen3.5 (tests/engine/conftest.py), block size 16
BLOCK = 2 * 16 * 2 * 32 * 4  # K+V x tokens x KV heads x head dim x float32, one attention layer
SLOT = 3 * (256 * 3 * 4 + 4 * 32 * 32 * 4)  # three DeltaNet layers: conv window + recurrent state


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def prompts(order=slice(None)) -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS[order]]


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_checkpoint):
    return tiny_hybrid_checkpoint("dense", INIT)


@pytest.fixture(scope="module")
def reference(hybrid):
    return token_ids(LLM(str(hybrid), dtype="float32", kv_cache_memory=SMALL).generate(prompts(), GREEDY))


SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False},
    # a draft model: the hybrid target itself, quantized (a hybrid draft, whose own state rewinds)
    "self_int4": {"model": "self", "quantization": "int4", "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.mark.parametrize("method", list(SPEC))
def test_greedy_output_is_unchanged_with_preemption_and_state_checkpoint_hits(method, hybrid, reference, assert_nothing_held):
    k = SPEC[method]["num_speculative_tokens"]
    # State for 4 sequences (a slot and k verification rows each), 4 checkpoints and 12 KV blocks
    # for 4 sequences growing to 50-64 tokens (4 blocks each): preemption is certain.
    memory = 4 * SLOT * (1 + k) + 4 * SLOT + 12 * BLOCK
    llm = LLM(str(hybrid), dtype="float32", kv_cache_memory=memory, max_model_len=128, max_num_seqs=4,
              state_checkpoint_interval=1, speculative_config=SPEC[method])
    assert llm.engine.pool.num_blocks == 12 and llm.engine.pool.num_state_checkpoints == 4
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert token_ids(llm.generate(prompts(slice(None, None, -1)), GREEDY)) == reference[::-1]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.state_checkpoints.restored > 0
    spec = stats.spec
    assert spec.num_accepted_tokens > 10, spec  # proposals kept, ...
    assert spec.num_proposed_tokens - spec.num_accepted_tokens > 10, spec  # ... and rejected
    assert_nothing_held(llm)
    if method == "self_int4":  # a hybrid draft: its shadows' state slots are free again too
        slots = llm.engine.speculator.proposer.state_slots
        assert slots.num_free == slots.num_slots


def test_a_hybrid_drafts_state_is_rewound_to_where_the_texts_agree(hybrid):
    """A hybrid draft (the target quantized to int4) whose proposals were rejected continues from
    the state after the tokens it shares with the target: after every step, its shadow's state is
    the state the same int4 model reaches by a prefill of those tokens."""
    llm = LLM(str(hybrid), dtype="float32", kv_cache_memory=SMALL, speculative_config=SPEC["self_int4"])
    reference = LLM(str(hybrid), dtype="float32", kv_cache_memory=SMALL, quantization="int4", max_num_seqs=1,
                    enable_prefix_caching=False)
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    engine.add_request({"prompt_token_ids": PROMPTS[3]}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    checked = 0
    while engine.has_unfinished_requests():
        rejected = engine.stats().spec.num_proposed_tokens - engine.stats().spec.num_accepted_tokens
        engine.step()
        (shadow,) = proposer._shadows.values() or [None]
        if shadow is None or not rejected:
            continue
        depth = proposer._slot_depth[shadow.seq_id]
        reference.generate({"prompt_token_ids": shadow.token_ids[:depth]}, SamplingParams(max_tokens=1))
        for ours, theirs in zip(proposer.runner.model.linear_attention_layers(),
                                reference.engine.runner.model.linear_attention_layers(), strict=True):
            # the reference's one sequence ran in slot 0, which keeps its state after it finished
            torch.testing.assert_close(ours.state.recurrent[shadow.state_slot], theirs.state.recurrent[0])
            torch.testing.assert_close(ours.state.conv[shadow.state_slot], theirs.state.conv[0])
        checked += 1
    assert checked >= 5


def test_a_mixture_of_experts_target(tiny_hybrid_checkpoint, assert_nothing_held):
    path = str(tiny_hybrid_checkpoint("moe", INIT))
    want = token_ids(LLM(path, dtype="float32", kv_cache_memory=SMALL).generate(prompts()[:2], GREEDY))
    llm = LLM(path, dtype="float32", kv_cache_memory=SMALL, speculative_config=SPEC["ngram"])
    assert token_ids(llm.generate(prompts()[:2], GREEDY)) == want
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens > 5 and spec.num_proposed_tokens - spec.num_accepted_tokens > 5, spec
    assert_nothing_held(llm)


def test_the_portable_torch_path_keeps_the_accepted_state_too(hybrid, monkeypatch, assert_nothing_held):
    """Without the native kernels a verification chunk runs the chunked rule in pieces cut at
    every saved position (tuili/layers/deltanet.py `_pieces`); float32 greedy text is the same."""
    monkeypatch.setenv("TUILI_NATIVE_KERNELS", "0")
    want = token_ids(LLM(str(hybrid), dtype="float32", kv_cache_memory=SMALL).generate(prompts(slice(2, 3)), GREEDY))
    llm = LLM(str(hybrid), dtype="float32", kv_cache_memory=SMALL, speculative_config=SPEC["ngram"])
    assert not llm.engine.platform.native_kernels
    assert token_ids(llm.generate(prompts(slice(2, 3)), GREEDY)) == want
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens > 5 and spec.num_proposed_tokens - spec.num_accepted_tokens > 2, spec
    assert_nothing_held(llm)


def test_bf16_on_the_native_path_is_unchanged_too(hybrid, assert_nothing_held):
    """The DeltaNet kernels run a verification chunk token by token, as decodes: in bf16 the
    tokens and their logprobs are the same bits as without speculation."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    base = LLM(str(hybrid), dtype="bfloat16", kv_cache_memory=SMALL).generate(prompts(), params)
    llm = LLM(str(hybrid), dtype="bfloat16", kv_cache_memory=SMALL, speculative_config=SPEC["ngram"])
    got = llm.generate(prompts(), params)
    assert token_ids(got) == token_ids(base)
    for mine, theirs in zip(got, base, strict=True):
        assert [{t: p.logprob for t, p in row.items()} for row in mine.outputs[0].logprobs] == [
            {t: p.logprob for t, p in row.items()} for row in theirs.outputs[0].logprobs]
    assert llm.engine.stats().spec.num_accepted_tokens > 5
    assert_nothing_held(llm)


# ---- MTP ------------------------------------------------------------------------------------


def with_mtp(source, path):
    """`source`, a tiny Qwen3.5 checkpoint, copied to `path` with random mtp.* tensors added
    (transformers writes none): one MTP decoder layer shaped as the model's full-attention layer
    (a mixture of experts where the model has one), fc, its input norms and mtp.norm. fc's
    embedding half is near the identity, so that the step predicts roughly what the target's
    bigram does, and its proposals are sometimes kept."""
    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(3)

    def rand(*shape, scale):
        return torch.randn(shape, generator=generator) * scale

    layer = "model.layers.3."  # the full-attention layer
    mtp = {f"mtp.layers.0.{name.removeprefix(layer)}": rand(*t.shape, scale=0.02 if t.dim() > 1 else 0.1)
           for name, t in tensors.items() if name.startswith(layer)}  # fmt: skip
    hidden = tensors["model.norm.weight"].shape[0]
    mtp["mtp.fc.weight"] = rand(hidden, 2 * hidden, scale=0.02) + torch.cat(
        [torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = rand(hidden, scale=0.1)
    save_file(tensors | mtp, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def hybrid_mtp(hybrid, tmp_path_factory):
    return with_mtp(hybrid, tmp_path_factory.mktemp("hybrid") / "mtp")


MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}


def test_the_mtp_step_matches_transformers_layers(hybrid_mtp):
    """The MTP output at a prompt's last position and its chained proposals against the same
    step composed of transformers' own Qwen3.5 classes (decoder layer, RMSNorm) loaded with the
    mtp.* tensors: fc(concat(norm_e(embed(t_{p+1})), norm_h(h_p))), the layer, mtp.norm, the
    target's head; h_p the target's final hidden state; a chained step takes the previous
    output and the proposal before it."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    prompt = PROMPTS[2]
    llm = LLM(str(hybrid_mtp), dtype="float32", kv_cache_memory=SMALL,
              speculative_config=MTP | {"num_speculative_tokens": 2})
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # the prompt: its MTP entries, and the output at its last position
    (seq,) = engine.scheduler.running
    proposer = engine.speculator.proposer
    ours, position = proposer._last[seq.seq_id]
    assert position == len(prompt) - 1
    proposal = proposer.propose([seq], [2])[0].token_ids

    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_mtp, dtype=torch.float32).eval()
    config = hf.config
    config._attn_implementation = "eager"
    mtp = load_file(hybrid_mtp / "model.safetensors")
    layer = Qwen3_5DecoderLayer(config, layer_idx=3).eval()  # layer 3 is full attention
    layer.load_state_dict({n.removeprefix("mtp.layers.0."): t for n, t in mtp.items() if n.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].load_state_dict({"weight": mtp[f"mtp.{name}.weight"]})
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.load_state_dict({"weight": mtp["mtp.fc.weight"]})
    ids = prompt + seq.token_ids[len(prompt):]  # the prompt and the token the target sampled

    def mtp_step(next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        embeds = hf.model.embed_tokens(torch.tensor([next_ids]))
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](embeds), norms["pre_fc_norm_hidden"](hidden)], dim=-1))
        length = x.shape[1]
        positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
        mask = torch.full((length, length), float("-inf")).triu(1).view(1, 1, length, length)
        y = layer(x, position_embeddings=hf.model.rotary_emb(x, positions), attention_mask=mask)
        return norms["norm"](y)

    with torch.no_grad():
        h = hf.model(torch.tensor([prompt])).last_hidden_state  # after the final norm
        y = mtp_step(ids[1:], h)
        want = hf.lm_head(y[0, -1])
        got = engine.model.compute_logits(ours[None])[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        # The chain: one more position, fed the first proposal and the last output.
        first = int(want.argmax())
        y2 = mtp_step(ids[1:] + [first], torch.cat([h, y[:, -1:]], dim=1))
        assert proposal == [first, int(hf.lm_head(y2[0, -1]).argmax())]


def test_mtp_greedy_output_is_unchanged_with_preemption_and_prefix_hits(hybrid_mtp, reference, assert_nothing_held):
    k = MTP["num_speculative_tokens"]
    memory = 4 * SLOT * (1 + k) + 4 * SLOT + 12 * BLOCK
    llm = LLM(str(hybrid_mtp), dtype="float32", kv_cache_memory=memory, max_model_len=128, max_num_seqs=4,
              state_checkpoint_interval=1, speculative_config=MTP)
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert token_ids(llm.generate(prompts(slice(None, None, -1)), GREEDY)) == reference[::-1]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.state_checkpoints.restored > 0
    spec = stats.spec
    assert spec.method == "mtp"
    assert spec.num_accepted_tokens > 5 and spec.num_proposed_tokens - spec.num_accepted_tokens > 10, spec
    assert spec.num_emitted_tokens == spec.num_verifications + spec.num_accepted_tokens
    assert_nothing_held(llm)
    assert not llm.engine.speculator.proposer._last


def test_mtp_with_a_mixture_of_experts_target(tiny_hybrid_checkpoint, tmp_path, assert_nothing_held):
    """Qwen3.5-MoE's MTP layer is a mixture of experts too (routed experts and a shared one)."""
    path = str(with_mtp(tiny_hybrid_checkpoint("moe", INIT), tmp_path / "moe_mtp"))
    want = token_ids(LLM(path, dtype="float32", kv_cache_memory=SMALL).generate(prompts(), GREEDY))
    llm = LLM(path, dtype="float32", kv_cache_memory=SMALL, speculative_config=MTP)
    assert any(name.startswith("mlp.experts") for name, _ in llm.engine.speculator.proposer.mtp.layers[0].named_modules())
    assert token_ids(llm.generate(prompts(), GREEDY)) == want
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens > 5 and spec.num_proposed_tokens - spec.num_accepted_tokens > 10, spec
    assert_nothing_held(llm)


@pytest.mark.parametrize("checkpoint", ["hybrid", "llama"])
def test_mtp_without_mtp_weights_is_refused_by_name(checkpoint, hybrid, tiny_llama):
    path = hybrid if checkpoint == "hybrid" else tiny_llama
    with pytest.raises(TuiliError, match=r"method='mtp' needs a checkpoint with multi-token-prediction weights"):
        LLM(str(path), dtype="float32", kv_cache_memory=SMALL, speculative_config=MTP)


def test_nothing_leaks_after_aborts_mid_draft_rejections_and_errors(hybrid_mtp, reference, abort_odd_requests, assert_nothing_held):
    """With MTP proposals (and the hybrid's verification rows): greedy and sampled requests,
    some aborted mid-generation, one refused; every block, slot and kept MTP output is freed."""
    llm = LLM(str(hybrid_mtp), dtype="float32", kv_cache_memory=SMALL, max_model_len=128,
              state_checkpoint_interval=1, speculative_config=MTP)
    engine = llm.engine
    abort_some = abort_odd_requests(engine)

    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=s)
              for s, t in enumerate([0, 0.8, 0, 1.0])]
    outs = llm.generate(prompts(), params, on_step=abort_some)
    assert abort_some.aborted and any(o.outputs[0].finish_reason == "abort" for o in outs)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(prompts()[:2], [SamplingParams(), SamplingParams(max_tokens=0)])
    spec = engine.stats().spec
    assert spec.num_proposed_tokens - spec.num_accepted_tokens > 10, spec
    assert_nothing_held(llm)
    assert not engine.speculator.proposer._last
    # The engine still serves, and greedy text is still the target's.
    assert token_ids(llm.generate(prompts()[2:3], GREEDY)) == reference[2:3]


def test_mtp_from_a_gguf_file_written_by_llama_cpp(tmp_path, real_tokenizer_dirs, llama_cpp_convert, assert_nothing_held):
    """A Qwen3.5 checkpoint with an MTP block, converted by llama.cpp's own converter (the block
    becomes its `nextn.*` layer): speculating with it from the GGUF file keeps the greedy text of
    the safetensors checkpoint without speculation, and its proposals are verified and kept.
    The converter reads the vocabulary from Qwen3's tokenizer, so the model has its 151,936 rows."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256, initializer_range=INIT,
    )  # fmt: skip
    config.architectures = ["Qwen3_5ForCausalLM"]
    plain = tmp_path / "plain"
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(plain)
    hf_dir = with_mtp(plain, tmp_path / "mtp")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer_dirs["qwen3"] / name, hf_dir / name)
    gguf = llama_cpp_convert(hf_dir, tmp_path / "mtp-f32.gguf", "f32")

    want = token_ids(LLM(str(plain), dtype="float32", kv_cache_memory=SMALL).generate(prompts(), GREEDY))
    llm = LLM(str(gguf), dtype="float32", kv_cache_memory=SMALL, speculative_config=MTP)
    assert token_ids(llm.generate(prompts(), GREEDY)) == want
    spec = llm.engine.stats().spec
    assert spec.method == "mtp" and spec.num_verifications > 10 and spec.num_accepted_tokens > 0, spec
    assert_nothing_held(llm)

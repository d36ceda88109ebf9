"""`tuili plan --speculative-config`: the verification step, the proposer's forwards and memory.

The verification step the plan predicts is checked against the live meter's accounting of the
steps a real speculating engine scheduled (both ours, from different paths: the plan from chunk
shapes through the roofline, the meter from the StepRecord); the capacity the plan gives is
checked against the pools a speculating engine builds for the KV budget the plan names (a draft
model, a hybrid target, a hybrid target with its quantized self as a hybrid draft).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tuili import LLM, SamplingParams
from tuili.cli import main
from tuili.config import EngineConfig, ModelConfig
from tuili.engine.pool import plan_pool
from tuili.errors import TuiliError
from tuili.perf.cost import ModelCost
from tuili.perf.formats import weight_format
from tuili.perf.hardware import HardwareSpec, preset
from tuili.perf.measure import engine_storage
from tuili.perf.meter import UtilizationMeter
from tuili.perf.plan import PlanInputs, Roofline, make_plan
from tuili.perf.speculation import expected_tokens_per_step, mtp_cost, speculation_for

CARD = HardwareSpec(name="test card", peak_flops={"fp32": 1e12}, memory_bandwidth=1e10, memory_bytes=2**34,
                    origin="file")  # fmt: skip
LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)  # fmt: skip
QWEN3_5 = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=256,
               initializer_range=0.02)  # fmt: skip
PERIODIC = [[5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7], [1, 2, 3, 4] * 6 + [1, 2]]


def write(config: transformers.PretrainedConfig, path) -> str:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return write(transformers.LlamaConfig(**LLAMA), tmp_path_factory.mktemp("llama") / "target")


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory) -> str:
    """A one-layer Llama with the target's vocabulary."""
    return write(transformers.LlamaConfig(**{**LLAMA, "num_hidden_layers": 1}), tmp_path_factory.mktemp("llama") / "draft")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> str:
    """A tiny Qwen3.5: three Gated DeltaNet layers, then one of full attention."""
    config = transformers.Qwen3_5TextConfig(**QWEN3_5)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return write(config, tmp_path_factory.mktemp("qwen3_5") / "target")


@pytest.fixture(scope="module")
def hybrid_mtp(hybrid, tmp_path_factory) -> str:
    """The tiny Qwen3.5 with random mtp.* tensors added (transformers writes none): one MTP
    layer shaped as its full-attention layer, fc, the fc's input norms and mtp.norm."""
    path = tmp_path_factory.mktemp("qwen3_5") / "mtp"
    shutil.copytree(hybrid, path)
    tensors = load_file(path / "model.safetensors")
    layer = "model.layers.3."  # the full-attention layer
    mtp = {f"mtp.layers.0.{name.removeprefix(layer)}": torch.randn(t.shape) * 0.02
           for name, t in tensors.items() if name.startswith(layer)}  # fmt: skip
    h = QWEN3_5["hidden_size"]
    mtp["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.02
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = torch.ones(h)
    save_file(tensors | mtp, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def raw_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# ---- the expected tokens of a verification ---------------------------------------------------


def test_expected_tokens_per_step_is_the_kept_prefix_plus_one():
    # By hand: the i-th proposal is reached and kept with probability a^i; the target adds one.
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens_per_step(0.0, 4) == 1  # nothing kept: the target's own token
    assert expected_tokens_per_step(1.0, 4) == 5  # all kept, plus the bonus token
    assert expected_tokens_per_step(0.999999, 4) == pytest.approx(5, rel=1e-5)  # continuous at 1


# ---- the verification step against the live meter --------------------------------------------


class Records:
    wants_device_time = False

    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_predicted_verification_step_is_what_the_meter_counts(method, llama, llama_draft):
    """Every pure decode step of a speculating engine (verification chunks, plain decodes beside
    them): the plan's bytes and FLOPs for the same chunks equal the meter's; a draft forward's
    weights are the engine's draft's, counted by the plan from the draft's own tensors."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    if method == "draft_model":
        config = {"model": llama_draft, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(llama, dtype="float32", kv_cache_memory=1 << 20, speculative_config=config)
    engine = llm.engine
    records = Records()
    engine.add_observer(records)
    llm.generate([{"prompt_token_ids": p} for p in PERIODIC], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

    cost = ModelCost.from_config(raw_config(llama))
    storage = engine_storage(engine.model)
    speculation = speculation_for(config, 0.7, raw_config(llama), storage)
    if method == "draft_model":
        speculation = dataclasses.replace(speculation, proposer_weights=engine_storage(engine.speculator.proposer.runner.model))
    roof = Roofline(cost, CARD, PlanInputs(weights=storage, kv_dtype="fp32", conv_state_dtype="fp32",
                                           speculation=speculation))  # fmt: skip
    draft_bytes = engine.draft_weight_bytes()
    verifying = [r for r in records.records if r.verify_chunks and not r.prefill_chunks]
    assert len(verifying) >= 4
    assert any(r.decode_context_lens for r in verifying) or method == "draft_model"
    for record in verifying:
        meter = UtilizationMeter(cost, CARD, engine.weight_bytes(), engine.pool.kv_bytes_per_token,
                                 compute_dtype="fp32", draft_weight_bytes=draft_bytes)  # fmt: skip
        meter.on_step(record)
        step = roof.speculative_step(record.decode_context_lens, record.verify_chunks, record.draft_forwards)
        assert step.verify.flops == meter.decode_flops
        assert step.verify.bytes == pytest.approx(meter.decode_bytes - record.draft_forwards * draft_bytes, abs=2)
        assert len(step.proposer) == (record.draft_forwards if method == "draft_model" else 0)
        if method == "draft_model":
            assert record.draft_forwards >= 1  # fewer than k as max_tokens nears
            # The draft's weights one forward reads: the engine leaves out the one embedding row a
            # token looks up, the cost model counts it (as for the target).
            proposer = roof.proposer()
            assert proposer is not None
            assert proposer.cost.decode_weight_bytes(proposer.inputs.weights, 1) == draft_bytes + LLAMA["hidden_size"] * 4


def test_a_uniform_verification_is_the_sum_of_its_chunks():
    """verify_uniform at context c, batch b, k proposals = verify of b chunks (c - 1, k + 1); it
    computes k + 1 positions per sequence (FLOPs at contexts c .. c + k, logits each), reads the
    weights once and each sequence's KV once at c + k, and the meter counts the same."""
    raw = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 5000,
           "tie_word_embeddings": True}  # fmt: skip
    cost = ModelCost.from_config(raw)
    spec = speculation_for({"method": "ngram", "num_speculative_tokens": 4}, 0.7, raw, weight_format("fp32"))
    roof = Roofline(cost, CARD, PlanInputs(weights=weight_format("fp32"), kv_dtype="fp32", speculation=spec))
    uniform, chunks = roof.verify_uniform(100, 3, 4), roof.verify([(99, 5)] * 3)
    assert (uniform.flops, uniform.bytes, uniform.seconds) == (chunks.flops, chunks.bytes, chunks.seconds)
    assert uniform.flops == 3 * sum(cost.flops_per_token(c) for c in range(100, 105))
    assert uniform.bytes == cost.weight_bytes("fp32") + 3 * 104 * cost.kv_bytes_per_token("fp32")
    meter = UtilizationMeter(cost, CARD, cost.weight_bytes("fp32"), cost.kv_bytes_per_token("fp32"),
                             compute_dtype="fp32")  # fmt: skip
    meter.record_step([], [], 1.0, verify_chunks=[(99, 5)] * 3, num_accepted=6)
    assert (meter.decode_flops, meter.decode_bytes) == (uniform.flops, uniform.bytes)
    # n-gram proposes for free: the speculating step is the verification alone
    step = roof.speculative(100, 3)
    assert step.proposer == () and step.seconds == uniform.seconds


# ---- memory: plan and engine agree on the requests that fit ------------------------------------


def engine_memory(engine) -> tuple[int, int]:
    """(bytes of the target's pool: blocks, state slots with their verification rows,
    checkpoints; bytes the proposer holds beside it: a draft's KV pool and state rows)."""
    pool = engine.pool
    target = (pool.num_blocks * pool.bytes_per_block
              + pool.num_state_slots * (1 + pool.verify_rows_per_slot) * pool.state_bytes_per_slot
              + pool.num_state_checkpoints * pool.state_bytes_per_slot)  # fmt: skip
    proposer = 0
    draft = getattr(engine.speculator.proposer, "pool", None)
    mtp = getattr(engine.speculator.proposer, "mtp", None)
    if mtp is not None:  # its layers' KV beside the target's blocks, and its scratch blocks
        proposer = sum(a.kv_cache.key.untyped_storage().nbytes() + a.kv_cache.value.untyped_storage().nbytes()
                       for a in mtp.attention_layers())  # fmt: skip
    if draft is not None:
        proposer = (draft.num_blocks * draft.bytes_per_block
                    + (draft.num_state_slots + draft.num_state_checkpoints) * draft.state_bytes_per_slot)  # fmt: skip
    return target, proposer


CONTEXT = 64  # 4 blocks of 16


@pytest.mark.parametrize("case", ["llama_draft", "hybrid_ngram", "hybrid_self_int4", "hybrid_mtp"])
def test_plan_and_engine_agree_on_concurrent_requests(case, llama, llama_draft, hybrid, hybrid_mtp):
    """For the budget beside the weights, the plan's max_concurrent_requests N: an engine given
    the plan's kv_cache_memory and max_num_seqs N holds N requests of the planned context (state
    slots and KV blocks), its proposer's pool and state fit in the rest of the budget, and the
    target's pool cannot hold N + 1."""
    target, budget, config = {
        "llama_draft": (llama, 1 << 20, {"model": llama_draft, "num_speculative_tokens": 3}),
        "hybrid_ngram": (hybrid, 8 << 20, {"method": "ngram", "num_speculative_tokens": 4}),
        "hybrid_self_int4": (hybrid, 8 << 20, {"model": "self", "quantization": "int4", "num_speculative_tokens": 3}),
        "hybrid_mtp": (hybrid_mtp, 8 << 20, {"method": "mtp", "num_speculative_tokens": 3}),
    }[case]
    raw = raw_config(target)
    cost, storage = ModelCost.from_config(raw), weight_format("fp32")
    spec = speculation_for(config, 0.7, raw, storage)
    card = dataclasses.replace(CARD, memory_bytes=cost.weight_bytes(storage) + spec.proposer_held_bytes() + budget)
    inputs = PlanInputs(weights=storage, kv_dtype="fp32", conv_state_dtype="fp32", context=CONTEXT, prompt=32,
                        output=32, reserve_fraction=0.0, speculation=spec)  # fmt: skip
    plan = make_plan(cost, card, inputs)
    n, kv_cache_memory = plan["max_concurrent_requests"], plan["kv_cache_memory_bytes"]
    assert n >= 4 and isinstance(kv_cache_memory, int)
    assert (kv_cache_memory < budget) if case != "hybrid_ngram" else kv_cache_memory == budget

    llm = LLM(target, dtype="float32", kv_cache_memory=kv_cache_memory, max_num_seqs=n, max_model_len=CONTEXT,
              speculative_config=config)  # fmt: skip
    engine = llm.engine
    pool = engine.pool
    if pool.num_state_slots:
        assert pool.num_state_slots == n and pool.verify_rows_per_slot == spec.k
        assert pool.num_state_checkpoints * pool.state_bytes_per_slot == plan["state_checkpoint_bytes_per_device"]
    assert pool.num_blocks >= n * CONTEXT // pool.block_size
    target_bytes, proposer_bytes = engine_memory(engine)
    assert target_bytes <= kv_cache_memory
    assert proposer_bytes <= budget - kv_cache_memory
    assert (proposer_bytes > 0) == (case != "hybrid_ngram")
    if case == "hybrid_mtp":  # the MTP block's own weights, as the engine holds them (float32)
        assert spec.proposer_held_bytes() == engine.draft_weight_bytes()
    # N + 1 sequences do not fit the target's pool at that budget
    model = ModelConfig.from_hf_config(raw)
    more = plan_pool(model, EngineConfig(kv_cache_memory=kv_cache_memory, max_num_seqs=n + 1, max_model_len=CONTEXT,
                                         speculative_config=spec.config), torch.float32, torch.device("cpu"))  # fmt: skip
    assert min(more.num_blocks // (CONTEXT // more.block_size), more.num_state_slots or n + 1) < n + 1


def test_without_speculation_the_capacity_is_unchanged():
    raw = dict(LLAMA, model_type="llama")
    cost = ModelCost.from_config(raw)
    card = preset("l40s")
    plain = make_plan(cost, card, PlanInputs(weights=weight_format("bf16"), context=4096))
    ngram = speculation_for({"method": "ngram", "num_speculative_tokens": 4}, 0.7, raw, weight_format("bf16"))
    spec = make_plan(cost, card, PlanInputs(weights=weight_format("bf16"), context=4096, speculation=ngram))
    # prompt lookup holds nothing, and a model without linear attention has no state rows
    assert spec["max_concurrent_requests"] == plain["max_concurrent_requests"]
    assert plain["speculative_method"] is None and spec["speculative_method"] == "ngram"


def test_mtp_counts_its_block_and_the_shared_head():
    """An MTP block of one full-attention layer with the target's MLP, its fc (2h -> h) and norms;
    a forward reads it and the target's output head; it holds its layer's KV per token."""
    raw = {"model_type": "qwen3_5_text", **QWEN3_5, "mtp_num_hidden_layers": 1, "tie_word_embeddings": False}
    block, target = mtp_cost(raw), ModelCost.from_config(raw)
    h = QWEN3_5["hidden_size"]
    kinds, target_kinds = block.params_by_kind(), target.params_by_kind()
    assert kinds["linear_attention"] == 0
    assert kinds["mlp"] == target_kinds["mlp"] // 4  # one of the target's four layers' MLP
    assert kinds["attention"] == target_kinds["attention"] + 2 * h * h  # the target's one attention layer + fc
    assert block.kv_bytes_per_token("bf16") == target.kv_bytes_per_token("bf16")  # one attention layer each
    spec = speculation_for({"method": "mtp", "num_speculative_tokens": 2}, 0.7, raw, weight_format("bf16"))
    head_and_embedding = 2 * 2 * QWEN3_5["vocab_size"] * h
    assert spec.proposer_held_bytes() == block.weight_bytes("bf16") - head_and_embedding
    roof = Roofline(target, CARD, PlanInputs(weights=weight_format("bf16"), batch=1, speculation=spec))
    step = roof.speculative(100, 1)
    assert len(step.proposer) == 2
    assert step.proposer[0].bytes == block.decode_weight_bytes("bf16", 1) + 100 * block.kv_bytes_per_token("bf16")
    with pytest.raises(TuiliError, match="method='mtp' needs a checkpoint with multi-token-prediction layers"):
        mtp_cost(dict(LLAMA, model_type="llama"))


# ---- the command line --------------------------------------------------------------------------


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(LLAMA, model_type="llama", hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=16, num_attention_heads=16, vocab_size=32000)))  # fmt: skip
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_tokens_per_second_with_and_without_speculation(capsys, config_file, tmp_path):
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(dict(LLAMA, model_type="llama", hidden_size=512, intermediate_size=1024,
                                     num_hidden_layers=4, num_attention_heads=8, vocab_size=32000)))  # fmt: skip
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 3})
    code, out, err = run(capsys, "--config", str(config_file), "--hardware", "h100-sxm", "--speculative-config", spec,
                         "--spec-acceptance", "0.8", "--batch", "8", "--json")  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["spec_tokens_per_step"] == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert plan["spec_acceptance"] == 0.8 and plan["num_speculative_tokens"] == 3
    row = next(r for r in plan["spec_by_batch"] if r["batch"] == 8)
    assert row["tokens_per_second"] == pytest.approx(plan["decode_tokens_per_second"])
    assert row["speculative_tokens_per_second"] == pytest.approx(plan["spec_decode_tokens_per_second"])
    # at batch 1 on an H100 a decode step is all weight reads: verifying 4 rows costs about one
    assert plan["spec_by_batch"][0]["speedup"] > 1.5
    assert plan["proposer_weights_bytes"] > 0 and plan["spec_proposer_seconds"] > 0
    code, out, _ = run(capsys, "--config", str(config_file), "--hardware", "h100-sxm", "--speculative-config", spec)
    assert code == 0
    assert "speculation" in out and "without, then with speculation" in out and "speedup" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--spec-acceptance", "1.5"],
         "--spec-acceptance 1.5 is invalid: expected the probability"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--spec-acceptance", "-0.1"],
         "--spec-acceptance -0.1 is invalid"),
        (["--spec-acceptance", "0.5"], "add --speculative-config"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
         "speculative_config num_speculative_tokens=0 is invalid"),
        (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
         "speculative_config method='medusa' is not supported"),
        (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'],
         "method='mtp' needs a checkpoint with multi-token-prediction layers"),
        (["--speculative-config", '{"model": "/nonexistent/draft", "num_speculative_tokens": 2}'], "/nonexistent/draft"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--tp", "2"],
         "is not modelled"),
        (["--speculative-config", '{"model": "BIG_DRAFT", "num_speculative_tokens": 2}'],
         "has vocab_size=64000, more than the target's 32000"),
    ],
)
def test_bad_speculation_arguments_are_clear_errors(capsys, config_file, argv, message):
    if any("BIG_DRAFT" in a for a in argv):  # a draft with a larger vocabulary than the target
        big = config_file.parent / "big.json"
        big.write_text(json.dumps({**json.loads(config_file.read_text()), "vocab_size": 64000}))
        argv = [a.replace("BIG_DRAFT", str(big)) for a in argv]
    code, out, err = run(capsys, "--config", str(config_file), "--hardware", "h100-sxm", *argv)
    assert code == 2 and not out
    assert message in err and "Traceback" not in err


def test_a_config_that_is_not_json_is_refused_by_argparse(capsys, config_file):
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(config_file), "--speculative-config", "{ngram"])
    assert "is not valid JSON" in capsys.readouterr().err


def test_plan_measure_runs_the_engine_speculating(tmp_path, capsys, monkeypatch, llama, llama_draft):
    """`tuili plan --measure --speculative-config`: the engine runs with the draft, its steps
    are compared with the predicted verification and draft forwards, and the run's acceptance
    is set beside the assumed one."""
    monkeypatch.setenv("TUILI_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "cpu.json"
    spec.write_text(json.dumps({"name": "cpu", "peak_flops": {"fp32": 5e10}, "memory_bandwidth": 5e9,
                                "memory_bytes": 2**33}))  # fmt: skip
    config = json.dumps({"model": llama_draft, "num_speculative_tokens": 2, "adaptive": False})
    assert main(["plan", "--model", llama, "--hardware", str(spec), "--device", "cpu", "--dtype", "float32",
                 "--measure", "--prompt", "12", "--output", "8", "--batch", "2", "--speculative-config", config,
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["comparisons"]}
    for row in rows.values():
        assert row["predicted"] > 0 and row["measured"] > 0
    note = next(n for n in report["notes"] if n.startswith("speculation"))
    assert "the plan assumes acceptance 0.7" in note and "decode steps verified" in note


def test_plan_of_an_mtp_checkpoint_counts_its_block_from_the_checkpoint(capsys, hybrid_mtp):
    """`tuili plan --model` reads the checkpoint's headers: its mtp.* tensors are left out of the
    language model's weights and counted as the proposer's, at the bytes per parameter stored."""
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    code, out, err = run(capsys, "--model", hybrid_mtp, "--hardware", "h100-sxm", "--speculative-config", spec, "--json")
    assert code == 0, err
    plan = json.loads(out)
    mtp_tensors = {n: t for n, t in load_file(Path(hybrid_mtp) / "model.safetensors").items() if n.startswith("mtp.")}
    assert plan["proposer_weights_bytes"] == sum(t.numel() * t.element_size() for t in mtp_tensors.values())
    assert plan["speculative_method"] == "mtp" and plan["spec_proposer_seconds"] > 0


def test_a_mixture_of_experts_verification_reads_the_experts_of_all_its_rows():
    """A verification chunk of 4 rows routes 4 tokens: the expected experts touched by 4 tokens
    (uniform routing), in the plan and in the meter alike; more than one decode reads."""
    raw = {"model_type": "qwen3_moe", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 5000, "num_experts": 16, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128}  # fmt: skip
    cost = ModelCost.from_config(raw)
    spec = speculation_for({"method": "ngram", "num_speculative_tokens": 3}, 0.7, raw, weight_format("fp32"))
    roof = Roofline(cost, CARD, PlanInputs(weights=weight_format("fp32"), kv_dtype="fp32", speculation=spec))
    meter = UtilizationMeter(cost, CARD, cost.weight_bytes("fp32"), cost.kv_bytes_per_token("fp32"),
                             compute_dtype="fp32")  # fmt: skip
    meter.record_step([], [], 1.0, verify_chunks=[(20, 4)])
    step = roof.verify([(20, 4)])
    assert step.bytes == pytest.approx(meter.decode_bytes, abs=2)
    assert step.bytes == cost.decode_weight_bytes("fp32", 4) + 24 * cost.kv_bytes_per_token("fp32")
    assert cost.decode_weight_bytes("fp32", 4) > cost.decode_weight_bytes("fp32", 1)


def test_end_to_end_speculating_takes_fewer_steps():
    raw = dict(LLAMA, model_type="llama")
    cost = ModelCost.from_config(raw)
    inputs = PlanInputs(weights=weight_format("bf16"), prompt=100, output=33, batch=1)
    plain = make_plan(cost, preset("h100-sxm"), inputs)
    # acceptance 1 and k = 3: four tokens a step, so the 32 tokens after the first take 8 steps
    spec = speculation_for({"method": "ngram", "num_speculative_tokens": 3}, 1.0, raw, weight_format("bf16"))
    fast = make_plan(cost, preset("h100-sxm"), dataclasses.replace(inputs, speculation=spec))
    roof = Roofline(cost, preset("h100-sxm"), dataclasses.replace(inputs, speculation=spec))
    steps = sum(roof.speculative(101 + 4 * j, 1).seconds for j in range(8))
    assert fast["spec_e2e_seconds"] == pytest.approx(plain["ttft_seconds"] + steps)
    assert fast["spec_e2e_seconds"] < plain["e2e_seconds"]

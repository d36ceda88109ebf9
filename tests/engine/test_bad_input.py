"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from tuili import LLM, SamplingParams
from tuili.errors import CheckpointError, RequestError, UnsupportedModelError


def test_missing_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(model="/nonexistent/model", device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(model=str(tmp_path), device="cpu")


def test_unsupported_architecture_lists_supported(tiny_llama, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(model=str(bad), device="cpu")


def test_mistral_sliding_window_refused(tiny_llama, tmp_path):
    bad = tmp_path / "mistral"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="sliding_window=4096"):
        LLM(model=str(bad), device="cpu")


def test_truncated_safetensors(tiny_llama, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_llama, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        LLM(model=str(bad), device="cpu")


def test_garbage_safetensors(tiny_llama, tmp_path):
    bad = tmp_path / "garbage"
    shutil.copytree(tiny_llama, bad)
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError):
        LLM(model=str(bad), device="cpu")


def test_missing_tensor_named(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(tiny_llama, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(model=str(bad), device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kwargs)


def test_bad_requests_do_not_disturb_a_running_one(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    engine = llm.engine
    good = engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(RequestError, match="prompt has 100 tokens but max_model_len is 64"):
        engine.add_request({"prompt_token_ids": [5] * 100})
    with pytest.raises(RequestError, match="empty"):
        engine.add_request({"prompt_token_ids": []})
    with pytest.raises(RequestError, match="token id 999"):
        engine.add_request({"prompt_token_ids": [1, 999]})
    with pytest.raises(RequestError, match="no tokenizer"):
        engine.add_request("text needs a tokenizer")
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out
    assert done.request_id == good and len(done.outputs[0].token_ids) == 8
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_max_model_len_larger_than_pool_is_refused(tiny_llama):
    from tuili.errors import TuiliError

    with pytest.raises(TuiliError, match="kv_cache_memory"):
        LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=200, kv_cache_memory=4096)


def test_a_request_aborted_from_on_step_ends_generate(tiny_llama):
    """Issue 20.8: aborting a request from on_step used to leave generate() stepping an empty
    engine forever; now the aborted request comes back as it stood, finish_reason "abort"."""
    llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    steps = []

    def abort_the_second(outputs):
        steps.append(len(outputs))
        assert len(steps) < 100, "generate() kept stepping after the abort"
        for out in outputs:
            if out.request_id.endswith("-1") and not out.finished and len(out.outputs[0].token_ids) >= 3:
                llm.engine.abort_request(out.request_id)

    outs = llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4]}], params, on_step=abort_the_second)
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 20
    aborted = outs[1].outputs[0]
    assert aborted.finish_reason == "abort" and 3 <= len(aborted.token_ids) < 20 and outs[1].finished
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    # The next call is not confused by the earlier call's outputs.
    again = llm.generate([{"prompt_token_ids": [1, 2]}], params)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_an_output_is_a_snapshot(tiny_llama):
    """Issue 20.2: an output's logprobs were the engine's live list (its token ids a copy), so a
    reader holding an output across later steps saw the two grow apart."""
    llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=6, logprobs=2, n=2, ignore_eos=True))
    first = engine.step()[0]
    while engine.has_unfinished_requests():
        engine.step()
    for choice in first.outputs:
        assert len(choice.token_ids) == len(choice.logprobs) == 1

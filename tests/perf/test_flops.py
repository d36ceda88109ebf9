"""FLOPs of the cost model against torch's FLOP counter running transformers' own models.

torch.utils.flop_counter counts 2mnk for every matmul (aten.mm, or aten.addmm with a bias, for
the linear layers and the lm_head; aten.bmm for eager attention's QK^T and PV). Eager attention computes the full L x L
score matrix and masks it, so for a prefill the counter's attention is the full square while the
cost model counts only the keys each query may see, L(L+1)/2 of them: the test scales the
reference by (L+1)/(2L). A decode step (one query over the cache) needs no scaling.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from tuili.perf.cost import ModelCost

TINY_QWEN3 = {
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 300, "tie_word_embeddings": False,
}
TINY_QWEN2_TIED = {
    "model_type": "qwen2", "hidden_size": 96, "intermediate_size": 200, "num_attention_heads": 6,
    "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 250, "tie_word_embeddings": True,
}
TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 48,
    "num_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_hidden_layers": 2, "vocab_size": 300, "tie_word_embeddings": False,
}
TINY_MISTRAL_WINDOW = {
    "model_type": "mistral", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 300, "sliding_window": 5,
}


def reference_counts(config: dict, prompt_len: int) -> tuple[dict[str, int], dict[str, int]]:
    """FLOPs by aten op of transformers' prefill (logits of the last token only) and of the next
    decode step, with eager attention and eager experts so every product is a counted matmul."""
    cfg = AutoConfig.for_model(**config, experts_implementation="eager")
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, config["vocab_size"], (1, prompt_len))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FlopCounterMode(display=False) as prefill:
            out = model(ids, logits_to_keep=1, use_cache=True)
        with FlopCounterMode(display=False) as decode:
            model(torch.randint(0, config["vocab_size"], (1, 1)), past_key_values=out.past_key_values, use_cache=True)

    def by_op(counter: FlopCounterMode) -> dict[str, int]:
        counts = {str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts()["Global"].items()}
        counts["linear"] = counts.pop("mm", 0) + counts.pop("addmm", 0)
        return counts

    return by_op(prefill), by_op(decode)


@pytest.mark.parametrize("config", [TINY_QWEN3, TINY_QWEN2_TIED, TINY_QWEN3_MOE], ids=["qwen3", "qwen2-tied", "qwen3-moe"])
def test_prefill_and_decode_flops_match_torch_flop_counter(config):
    prompt_len = 12
    prefill, decode = reference_counts(config, prompt_len)
    cost = ModelCost.from_config(config)
    causal_attention = prefill["bmm"] * (prompt_len + 1) // (2 * prompt_len)
    assert cost.prefill_flops(0, prompt_len) == prefill["linear"] + causal_attention
    assert cost.decode_flops([prompt_len + 1]) == decode["linear"] + decode["bmm"]


def test_sliding_window_decode_reads_only_the_window():
    prompt_len = 12
    prefill, decode = reference_counts(TINY_MISTRAL_WINDOW, prompt_len)
    cost = ModelCost.from_config(TINY_MISTRAL_WINDOW)
    assert cost.decode_flops([prompt_len + 1]) == decode["linear"] + decode["bmm"]
    # the prefill's matmuls match; its attention counts fewer keys than the masked full square
    no_window = ModelCost.from_config({**TINY_MISTRAL_WINDOW, "sliding_window": None})
    attention = cost.prefill_flops(0, prompt_len) - prefill["linear"]
    assert 0 < attention < no_window.prefill_flops(0, prompt_len) - prefill["linear"]


def test_chunked_prefill_adds_up_to_one_prefill():
    cost = ModelCost.from_config(TINY_QWEN3)
    whole = cost.prefill_flops(0, 100)
    chunks = cost.prefill_flops(0, 37, logits=False) + cost.prefill_flops(37, 40, logits=False) + cost.prefill_flops(77, 23)
    assert chunks == whole
    # a prefill of one token after c-1 cached ones is exactly a decode step at context c
    assert cost.prefill_flops(99, 1) == cost.decode_flops([100])

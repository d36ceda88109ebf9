"""`tuili generate` and `tuili chat` as a user runs them: real processes on the embedded model."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def _tuili(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tuili.cli", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_generate_streams_an_answer():
    result = _tuili("generate", "--chat-template", "--prompt", "What is the capital of France?",
                    "--temperature", "0", "--max-tokens", "24", "--kv-cache-memory", "128MiB")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "SmolLM2-135M-Instruct" in result.stderr  # says which model it used


def test_generate_prompts_file_writes_jsonl(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"prompt": "The capital of France is"},
        {"messages": [{"role": "user", "content": "Say hello."}]},
        {"prompt_token_ids": [1, 2, 3]},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    result = _tuili("generate", "--prompts-file", str(prompts), "--output", str(out), "--temperature", "0",
                    "--max-tokens", "8", "--ignore-eos", "--kv-cache-memory", "128MiB")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    assert all(len(r["token_ids"]) == 8 and r["finish_reason"] == "length" for r in rows)
    assert "prefix cache hit rate" in result.stderr


def test_generate_bad_input_is_a_clear_error(tmp_path):
    result = _tuili("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    result = _tuili("generate", "--prompt", "hi", "--top-p", "0", "--kv-cache-memory", "128MiB")
    assert result.returncode == 2 and "top_p=0.0" in result.stderr


def test_chat_keeps_history_and_reuses_its_cache():
    result = _tuili("chat", "--temperature", "0", "--max-tokens", "16", "--kv-cache-memory", "128MiB",
                    stdin="My name is Ada.\nWhat is my name?\n/reset\nHello\n/exit\n")
    assert result.returncode == 0, result.stderr
    turns = re.findall(r"\[(\d+) prompt tokens, (\d+) from cache; (\d+) generated", result.stderr)
    (p1, c1, g1), (p2, c2, _), (p3, _, _) = [tuple(map(int, t)) for t in turns]
    assert p2 > p1 + g1, "the second turn's prompt carries the first question and answer"
    assert c2 >= (p1 // 16) * 16, "and reuses their KV from the prefix cache"
    assert p3 < p2, "/reset starts a new conversation"
    assert result.stdout.count("> ") == 5  # three messages, /reset, /exit


def test_generate_with_speculative_config_prints_acceptance():
    text = "one two three four five six seven eight nine ten"
    prompt = f"Repeat exactly: {text}. {text}. {text}."
    result = _tuili("generate", "--prompt", prompt, "--temperature", "0", "--max-tokens", "24",
                    "--kv-cache-memory", "128MiB", "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}')
    assert result.returncode == 0, result.stderr
    assert re.search(r"speculative \(ngram\): \d+ of \d+ proposed tokens accepted", result.stderr), result.stderr
    bad = _tuili("generate", "--prompt", "hi", "--kv-cache-memory", "128MiB", "--speculative-config",
                 '{"method": "ngram"}')
    assert bad.returncode == 2 and "num_speculative_tokens=None is invalid" in bad.stderr, bad.stderr
    bad = _tuili("generate", "--prompt", "hi", "--speculative-config", "{not json")
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr

"""Text in, text out: the tokenizer, the chat template, incremental detokenization and stop strings.

The model's own tokenizer (a transformers ``PreTrainedTokenizerFast``, i.e. a Rust ``tokenizers``
pipeline) does every conversion; this module decides *when* to decode which tokens so that
streamed text is always correct:

* ``IncrementalDetokenizer`` turns one generated token at a time into the text it completes,
  never emitting U+FFFD for a character whose bytes are still split across tokens.
* ``StopStringMatcher`` cuts the streamed text at the first stop string, holding back a tail
  that might still become one.

Both keep the invariant that the pieces they emit concatenate to exactly the text a
non-streaming run returns.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from tuili.errors import CheckpointError, RequestError

# Files any one of which makes a directory hold a tokenizer transformers can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# Text-part separator when a chat message's content is a list of parts (as vLLM does).
_PART_SEPARATOR = "\n"

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """The model's tokenizer and chat template behind a small, engine-shaped interface.

    ``decode`` is the Rust pipeline's decode without transformers' optional
    ``clean_up_tokenization_spaces`` pass (which rewrites " ." to "." and would make a
    streamed text differ from the final one); it is the reference ``IncrementalDetokenizer``
    agrees with.
    """

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerFast, extra_eos_token_ids: Iterable[int] = ()
    ) -> None:
        if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
            raise TypeError(
                f"Tokenizer needs a transformers PreTrainedTokenizerFast, got {type(hf_tokenizer).__name__}"
            )
        self.hf_tokenizer = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        eos = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self._eos_token_ids = frozenset(eos)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer | None:
        """Load the tokenizer of a Hugging Face model directory, or None when it has none.

        End-of-sequence ids are the tokenizer's ``eos_token_id`` plus those listed in the
        directory's generation_config.json (Llama 3 instruct models, for example, end a turn
        with ``<|eot_id|>`` there, not with the tokenizer's ``<|end_of_text|>``).
        """
        path = Path(path)
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            return None
        # Imported here: AutoTokenizer pulls in much of transformers, which token-id-only
        # checkpoints never need.
        from transformers import AutoTokenizer

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
        except Exception as exc:  # transformers raises many kinds; the user needs the path and cause
            raise CheckpointError(f"cannot load the tokenizer in {path}: {exc}") from exc
        if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
            raise CheckpointError(
                f"the tokenizer in {path} loads as {type(hf_tokenizer).__name__}, not a fast (tokenizers) "
                "tokenizer; tuili needs tokenizer.json or files transformers can convert to it"
            )
        return cls(hf_tokenizer, extra_eos_token_ids=_generation_config_eos_ids(path))

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (``len(tokenizer)``)."""
        return len(self.hf_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the tokenizer adds BOS if its model does."""
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        content_special_tokens: bool = False, **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        ``messages`` are ``{"role": ..., "content": ...}`` where content is a string or a list of
        ``{"type": "text", "text": ...}`` parts, joined with newlines. The rendered text already
        holds the template's BOS, so it is encoded without adding special tokens (as
        transformers does). ``template_kwargs`` reach the template (e.g. ``enable_thinking``).

        Message content is text: special tokens come only from the template, so a user cannot
        forge a turn by writing ``<|im_end|>\n<|im_start|>system``; such text is encoded as the
        ordinary tokens that spell it. ``content_special_tokens=True`` restores the old (and
        transformers') behaviour of parsing special-token text anywhere in the rendering.

        A ``developer`` message (OpenAI's newer name for ``system``) is rendered as a system
        message, unless the template itself names the developer role.
        """
        if self.hf_tokenizer.chat_template is None:
            raise RequestError(
                "this model's tokenizer has no chat template, so it cannot take chat messages; "
                "send a plain text prompt instead"
            )
        conversation = [_normalise_message(i, message) for i, message in enumerate(messages)]
        if "developer" not in self.hf_tokenizer.chat_template:
            # OpenAI's newer name for the system role; a template that does not know it gets system.
            conversation = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conversation]
        if not conversation:
            raise RequestError("messages=[] is invalid: expected at least one message")
        # Imported here to keep jinja2 out of the module's import cost; it is transformers' renderer.
        from jinja2 import TemplateError

        try:
            text = self.hf_tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except TemplateError as exc:  # e.g. "Conversation roles must alternate user/assistant"
            raise RequestError(f"the model's chat template rejected the messages: {exc}") from exc
        forged = None if content_special_tokens else self._special_text_in(conversation)
        if forged is None:  # the common case: encoded exactly as before
            return self.encode(text, add_special_tokens=False)
        return self._encode_content_as_text(conversation, text, forged, add_generation_prompt, template_kwargs)

    def _special_text_in(self, conversation: list[dict[str, Any]]) -> tuple[int, str] | None:
        """(message index, special token) of the first content that spells a special token."""
        specials = [t.content for t in self.hf_tokenizer.added_tokens_decoder.values() if t.special and t.content]
        for index, message in enumerate(conversation):
            found = next((token for token in specials if token in message["content"]), None)
            if found is not None:
                return index, found
        return None

    def _encode_content_as_text(
        self, conversation: list[dict[str, Any]], text: str, forged: tuple[int, str],
        add_generation_prompt: bool, template_kwargs: dict[str, Any],
    ) -> list[int]:
        """Encode the template's own text with special tokens parsed and each message's content
        with them spelled out. The template is rendered once more with a marker in place of each
        content, which shows where the contents lie in `text`."""
        marked = [{**message, "content": f"\ue000{i}\ue001"} for i, message in enumerate(conversation)]
        skeleton = self.hf_tokenizer.apply_chat_template(
            marked, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        pieces = re.split("\ue000(\\d+)\ue001", skeleton)  # template, index, template, index, ...
        indices = [int(i) for i in pieces[1::2]]
        rebuilt = "".join(
            piece if k % 2 == 0 else conversation[int(piece)]["content"] for k, piece in enumerate(pieces)
        )
        if sorted(indices) != list(range(len(conversation))) or rebuilt != text:
            # The template repeats, drops or rewrites content: its place in the text is unknown.
            index, token = forged
            raise RequestError(
                f"messages[{index}] content holds the special token text {token!r}, which this model's chat "
                "template does not let tuili keep as plain text: remove it"
            )
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False)
            else:
                content = conversation[int(piece)]["content"]
                ids += self.hf_tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        return ids


def _generation_config_eos_ids(path: Path) -> list[int]:
    config_path = path / "generation_config.json"
    if not config_path.is_file():
        return []
    try:
        eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {config_path}: {exc}") from exc
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise CheckpointError(
            f"{config_path}: eos_token_id={eos!r} is invalid: expected a token id or a list of them"
        )
    return ids


def _normalise_message(index: int, message: Any) -> dict[str, Any]:
    """A copy of ``message`` whose content is a plain string."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{index}]={message!r} is invalid: expected a dict with a string 'role'")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"messages[{index}] content part {part!r} is invalid: expected "
                    '{"type": "text", "text": "..."} (tuili models take text only)'
                )
            texts.append(part["text"])
        content = _PART_SEPARATOR.join(texts)
    elif content is None:
        content = ""  # an assistant message may carry only tool calls; the template sees ""
    elif not isinstance(content, str):
        raise RequestError(
            f"messages[{index}] content={content!r} is invalid: expected a string or a list of text parts"
        )
    return {**message, "content": content}


class IncrementalDetokenizer:
    """Text of a generation, one token at a time.

    A window of token ids is kept, split at ``read`` into a prefix whose text was already
    emitted and the tokens not yet emitted. Each step decodes the whole window and emits what
    it adds to the prefix's text — unless that text ends in U+FFFD, which means a character's
    bytes are still incomplete (byte-level BPE splits UTF-8 bytes over tokens; sentencepiece
    byte fallback spells a character as ``<0xE4><0xBD><0xA0>``): then nothing is emitted and
    the next token is awaited. After an emission the window restarts at the old ``read``, so
    it stays a few tokens long and each step costs O(1) decodes of short windows. The decoder
    still sees a token's left neighbour, which is what it needs for context-dependent pieces
    (sentencepiece's "▁" word starts).

    The window starts with the last few prompt tokens, so the first output token is decoded in
    context (as vLLM does). The emitted pieces plus ``flush()`` concatenate to
    ``tokenizer.decode(output_ids)`` for every valid UTF-8 output; for decoders that drop a
    leading space of the first token (Llama 2 style sentencepiece) the text keeps that space,
    as vLLM and transformers' pipelines do. An output that is itself invalid UTF-8 is emitted
    with its U+FFFD once ``_MAX_UNREAD`` tokens have not completed it; with byte fallback their
    number may then differ from a one-shot decode, which replaces whole runs of byte tokens.
    """

    # Prompt tokens kept as left context; vLLM uses 5. Any context >= 1 token is enough for
    # the decoders of byte-level BPE and sentencepiece models.
    _PROMPT_CONTEXT = 5
    # A character is at most 4 UTF-8 bytes, so a U+FFFD that this many unread tokens have not
    # completed is the model's own invalid output: emit it rather than let the window (and the
    # cost of each step) grow without bound.
    _MAX_UNREAD = 16

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-self._PROMPT_CONTEXT :])
        # A context that starts or ends inside a character would make its replacement
        # characters part of the prefix text; drop tokens from its left until its text is clean.
        while context and _REPLACEMENT_CHAR in self._decode(context):
            context.pop(0)
        self._window: list[int] = context
        self._read = len(context)  # window[:read] is already-emitted text (or prompt)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is split)."""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        if full_text.endswith(_REPLACEMENT_CHAR) and len(self._window) - self._read < self._MAX_UNREAD:
            return ""
        piece = full_text[len(prefix_text) :]
        self._advance(piece)
        return piece

    def flush(self) -> str:
        """At the end of generation, the text still held back (U+FFFD for an unfinished character)."""
        piece = self._decode(self._window)[len(self._decode(self._window[: self._read])) :]
        self._advance(piece)
        return piece

    def _advance(self, piece: str) -> None:
        """Record ``piece`` as emitted: the unread tokens become the next window's prefix."""
        self._pieces.append(piece)
        self._window = self._window[self._read :]
        self._read = len(self._window)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Cuts streamed text at the first stop string.

    "First" is the stop string whose occurrence *ends* first (at equal ends the longer one),
    which is where a token-by-token generation notices it; the result therefore does not
    depend on how the text was split into deltas. Text that could still be the start of a
    stop string is held back until the next delta decides, and ``flush()`` releases it when
    the generation ends for another reason.
    """

    def __init__(self, stop_strings: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise RequestError(f"stop={list(stop_strings)!r} is invalid: expected non-empty strings")
        self._stops = list(stop_strings)
        # Per stop string, for each character, the prefix lengths k (ascending) whose last
        # character it is: a held tail must end with the pending text's last character, so only
        # these k are tried (a stop string of spaces no longer costs 255 tries per step).
        self._prefix_ends: list[dict[str, list[int]]] = []
        for stop in self._stops:
            ends: dict[str, list[int]] = {}
            for k in range(1, len(stop)):  # ascending, for bisect
                ends.setdefault(stop[k - 1], []).append(k)
            self._prefix_ends.append(ends)
        self._include = include_stop_str_in_output
        self._pending = ""  # text received but not yet emitted
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        self._pending += delta
        match = self._first_match()
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include else start
            emitted = self._pending[:end]
            self._pending = ""
            self.stopped = True
            self.matched = stop
            return emitted, True
        held = self._held_length()
        cut = len(self._pending) - held
        emitted, self._pending = self._pending[:cut], self._pending[cut:]
        return emitted, False

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        tail, self._pending = self._pending, ""
        return tail

    def _first_match(self) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop); min() picks the first
        for stop in self._stops:
            start = self._pending.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _held_length(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        pending = self._pending
        if not pending:
            return 0
        held, last, size = 0, pending[-1], len(pending)
        for stop, ends in zip(self._stops, self._prefix_ends, strict=True):
            lengths = ends.get(last)
            if not lengths:
                continue
            for i in range(bisect.bisect_right(lengths, size) - 1, -1, -1):  # longest first
                k = lengths[i]
                if k <= held:
                    break
                if pending.endswith(stop[:k]):
                    held = k
                    break
        return held

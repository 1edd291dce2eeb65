"""Incremental detokenization and stop strings, on the frontend.

Mirrors vllm/v1/engine/detokenizer.py (FastIncrementalDetokenizer). NOTE: stop
*strings* are found here, not in the scheduler: the engine only sees token ids.
When one matches, the frontend finishes the request and sends an abort back to
the engine so its blocks are freed (vllm_v1_facts §7.3, §12.14).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from vllm_anatomy.sampling_params import SamplingParams

# Prompt tokens fed to a fresh stream so the first output token decodes in
# context (e.g. a leading space that depends on the previous token).
_PROMPT_SUFFIX_TOKENS = 4


class IncrementalDetokenizer:
    """Turns new token ids into new text, one step at a time, and checks stop strings."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._tok = tokenizer.backend_tokenizer  # the Rust `tokenizers.Tokenizer`
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop or []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # NOTE: while stop strings can still complete, hold back this many
        # characters from streamed text so a half-matched stop string is never shown.
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self.output_text = ""
        self.token_ids: list[int] = []
        self._prompt_suffix = list(prompt_token_ids[-_PROMPT_SUFFIX_TOKENS:])
        self._stream = self._new_stream()

    def _new_stream(self) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for tid in self._prompt_suffix:
            stream.step(self._tok, tid)
        return stream

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tok, token_id) or ""
        except Exception as e:  # the stream refuses a prefix it cannot continue
            if "Invalid prefix" not in str(e):
                raise
            self._stream = self._new_stream()
            return self._stream.step(self._tok, token_id) or ""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Detokenize new tokens; return the matched stop string, if any.

        stop_terminated: the engine stopped on EOS / a stop token — that last
        token is not turned into text (as vLLM, unless include_stop_str_in_output).
        """
        if not new_token_ids:
            return None
        stop_check_offset = len(self.output_text)
        self.token_ids.extend(new_token_ids)
        skip_last = stop_terminated and not self.include_stop_str_in_output
        for tid in new_token_ids[:-1] if skip_last else new_token_ids:
            self.output_text += self._step(tid)
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(stop_check_offset)

    def _check_stop_strings(self, new_char_offset: int) -> str | None:
        # Search only where a match can newly appear: the new text plus the
        # tail of the old text that a stop string could straddle.
        best: tuple[int, str] | None = None
        for s in self.stop:
            start = max(0, new_char_offset - len(s) + 1)
            idx = self.output_text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        end = idx + len(s) if self.include_stop_str_in_output else idx
        self.output_text = self.output_text[:end]
        return s

    def get_next_output_text(self, finished: bool, delta: bool, sent_len: int) -> str:
        """Text to show now: everything, or only what is new since sent_len."""
        length = len(self.output_text)
        if not finished:
            length -= self.stop_buffer_length
        length = max(length, sent_len)
        return self.output_text[sent_len:length] if delta else self.output_text[:length]

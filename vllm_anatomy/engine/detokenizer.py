"""Incremental detokenization and stop strings, on the frontend.

Mirrors vllm/v1/engine/detokenizer.py (FastIncrementalDetokenizer). NOTE: stop
*strings* are found here, not in the scheduler: the engine only sees token ids.
When one matches, the frontend finishes the request and sends an abort back to
the engine so its blocks are freed (vllm_v1_facts §7.3, §12.14).

NOTE: (ours) the stop strings are matched by one Aho-Corasick automaton fed the
new characters (stop_strings.py), not by one search per stop string per token
as in vLLM: the cost of a token no longer grows with the number of stop strings
(this runs on the HTTP server's event loop). Same answer as vLLM: the stop
string that ends first, ties by list order.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from vllm_anatomy.engine.stop_strings import get_stop_string_automaton
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams

# Prompt tokens fed to a fresh stream so the first output token decodes in
# context (e.g. a leading space that depends on the previous token).
_PROMPT_SUFFIX_TOKENS = 4


class IncrementalDetokenizer:
    """Turns new token ids into new text, one step at a time, and checks stop strings.

    NOTE: (ours; vLLM decodes every step) a FINAL_ONLY request without stop
    strings — every request of LLM.generate() that sets none — shows no text
    before it finishes and has no string to search for, so its tokens are
    only collected per step and decoded when `output_text` is first read: one
    DecodeStream call for all of them instead of one per token per step. The
    text is the same (test_output_processor checks it): the stream yields the
    same characters whether it is given the tokens one by one or together.
    """

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
        self.decode_when_read = params.output_kind == RequestOutputKind.FINAL_ONLY and not self.stop
        # The stop strings' automaton and where it stands after the text so far.
        self._stop_automaton = get_stop_string_automaton(tuple(self.stop)) if self.stop else None
        self._stop_state = 0
        self._output_text = ""
        self.token_ids: list[int] = []
        # token_ids[:_num_decoded] are in _output_text; token_ids[:_num_text_tokens]
        # should be (all but a final EOS / stop token that is not shown).
        self._num_decoded = 0
        self._num_text_tokens = 0
        self._prompt_suffix = list(prompt_token_ids[-_PROMPT_SUFFIX_TOKENS:])
        self._stream = self._new_stream()

    @property
    def output_text(self) -> str:
        if self._num_decoded < self._num_text_tokens:
            self._decode_pending()
        return self._output_text

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

    def _decode_pending(self) -> None:
        ids = self.token_ids[self._num_decoded:self._num_text_tokens]
        all_at_once = self.decode_when_read and self._num_decoded == 0 and len(ids) > 1
        self._num_decoded = self._num_text_tokens
        if all_at_once:
            # NOTE: the stream answers None when the text ends in an incomplete
            # character (it waits for more bytes), and may refuse a prefix; fed
            # one by one it would have yielded what came before, so then decode
            # again from a fresh stream (nothing was decoded yet), token by token.
            try:
                text = self._stream.step(self._tok, ids)
            except Exception:
                text = None
            if text is not None:
                self._output_text += text
                return
            self._stream = self._new_stream()
        for tid in ids:
            self._output_text += self._step(tid)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Detokenize new tokens; return the matched stop string, if any.

        stop_terminated: the engine stopped on EOS / a stop token — that last
        token is not turned into text (as vLLM, unless include_stop_str_in_output).
        """
        if not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        skip_last = stop_terminated and not self.include_stop_str_in_output
        self._num_text_tokens = len(self.token_ids) - 1 if skip_last else len(self.token_ids)
        if self.decode_when_read:
            return None
        stop_check_offset = len(self._output_text)
        self._decode_pending()
        if self._stop_automaton is None:
            return None
        # NOTE: before min_tokens the automaton still reads the text (a stop
        # string may begin there) but reports nothing, as vLLM skips the check.
        return self._check_stop_strings(stop_check_offset, report=len(self.token_ids) > self.min_tokens)

    def _check_stop_strings(self, new_char_offset: int, report: bool) -> str | None:
        """Feed the new text to the automaton; on a match, truncate the text there."""
        assert self._stop_automaton is not None
        text = self._output_text
        self._stop_state, match = self._stop_automaton.scan(self._stop_state, text, new_char_offset, report)
        if match is None:
            return None
        end, index = match
        s = self.stop[index]
        self._output_text = text[:end] if self.include_stop_str_in_output else text[:end - len(s)]
        return s

    def get_next_output_text(self, finished: bool, delta: bool, sent_len: int) -> str:
        """Text to show now: everything, or only what is new since sent_len."""
        text = self.output_text
        length = len(text)
        if not finished:
            length -= self.stop_buffer_length
        length = max(length, sent_len)
        return text[sent_len:length] if delta else text[:length]

"""The offline API: `LLM(...).generate(prompts, sampling_params)`.

Mirrors vllm/entrypoints/llm.py. Run:

    from vllm_anatomy import LLM, SamplingParams
    llm = LLM()                                  # the default SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

With SamplingParams(n=3, temperature=0.8) each RequestOutput holds three
CompletionOutputs (index 0, 1, 2): three child requests on one prompt.

With VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's default; ours is 0) EngineCore
runs in its own process while this one detokenizes; `llm.shutdown()`, a
`with LLM(...) as llm:` block, or the interpreter's exit stops it. That process
is started with "spawn" (it re-imports the main module), so a script that
builds an LLM there does it under `if __name__ == "__main__":`.
"""
from __future__ import annotations

import itertools
import time
import weakref
from typing import Any, Sequence

import msgspec
from tqdm.auto import tqdm

from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.input_processor import PromptType
from vllm_anatomy.engine.llm_engine import LLMEngine
from vllm_anatomy.engine.protocol import EngineCoreRequest
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams
from vllm_anatomy.tracing.recorder import Recorder


class LLM:

    def __init__(self, model: str | None = None, *, recorder: Recorder | None = None, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, recorder)
        self.request_counter = itertools.count()
        # NOTE: (ours) an LLM dropped without shutdown() shuts its engine down. EngineCore
        # gc.freeze()s its start-up heap (as vLLM's does) and the engine's objects form
        # cycles, so only shutdown's gc.unfreeze() lets the collector take the weights and
        # the KV cache back: without this, every LLM a notebook or a test file dropped kept
        # ~1 GB on a CPU for the life of the process. vLLM leaves that to its callers.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine (its process, if it has one) and flush the trace. Safe to call twice."""
        self._finalizer()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> dict[str, float]:
        """Cumulative counters since start-up, named like vLLM's Prometheus metrics."""
        return dict(self.llm_engine.counters)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: list[int] | None = None) -> list[RequestOutput]:
        """priority: one per prompt (under --scheduling-policy priority, lower runs first)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"The lengths of prompts ({len(prompts)}) and "
                                 f"sampling_params ({len(params_list)}) must be the same.")
        # NOTE: generate() returns finished requests only, so (as vLLM's LLM does)
        # ask for FINAL_ONLY outputs: the frontend then builds one RequestOutput per
        # request, not one per request per step (each copying the whole text so far).
        params_list = [_final_only(sp) for sp in params_list]
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and priority ({len(priority)}) must be the same.")
        priorities = priority if priority is not None else [0] * len(prompts)
        self._validate_and_add_requests(prompts, params_list, priorities)
        return self._run_engine(len(prompts), use_tqdm)

    def _validate_and_add_requests(self, prompts: Sequence[PromptType | Any], params_list: list[SamplingParams],
                                   priorities: Sequence[int]) -> None:
        """Tokenize and validate every prompt, then add them all; if one is refused, none stays.

        NOTE: (ours) every prompt is checked before any is added, so a bad one
        (too long, bad parameters) loses nothing. What can still fail is the add
        itself: a request id already in use, a dead engine, Ctrl-C halfway
        through a long batch. Then, as vLLM's _render_and_add_requests does,
        the requests this call already added are aborted (their blocks freed,
        their state gone from the frontend and the engine) before the error is
        raised: otherwise they would run on, held in the engine, and their
        outputs would come back from the next generate() call.
        """
        engine = self.llm_engine
        processed: list[tuple[str | None, EngineCoreRequest]] = []
        request_ids: list[str] = []
        added: list[str] = []
        try:
            for p, sp, prio in zip(prompts, params_list, priorities):
                processed.append(engine.process_inputs(str(next(self.request_counter)), p, sp, priority=prio))
                request_ids.append(processed[-1][1].request_id)
            for request_id, (prompt_text, request) in zip(request_ids, processed):
                # (read before adding: with n > 1 the object becomes the last child)
                engine.add_processed_request(prompt_text, request)
                added.append(request_id)
        except BaseException:
            # (an n > 1 request's id aborts its children; the engine is told unless it is dead)
            engine.abort_request(added)
            # (the spans of requests tokenized but never added end here; a no-op for those added)
            for rid in request_ids[len(added):]:
                engine.request_tracer.discard_admission(rid)
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.apply_chat_template(conv, tokenize=True,
                                                                add_generation_prompt=add_generation_prompt,
                                                                return_dict=False)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block (e.g. after loading new weights); False while a request
        holds blocks, unless reset_running_requests preempts them first."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pbar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True,
                    disable=not use_tqdm)
        finished: dict[str, RequestOutput] = {}
        out_tokens, start = 0, time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        pbar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} tok/s", refresh=False)
                        pbar.update(1)
        except BaseException:
            # NOTE: an interrupted generate() must not leave requests in the engine.
            engine.abort_request(list(engine.output_processor.request_states))
            raise
        finally:
            pbar.close()
        # Sort by request id (submission order), as vLLM does.
        return sorted(finished.values(), key=lambda o: int(o.request_id))


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)  # the caller's is untouched

"""A stand-in for vLLM in the CPU smoke tests of bench/vs_vllm.py and bench/scaling.py.

The real vLLM needs a GPU: this package takes its place on the worker's PYTHONPATH
(`--vllm-site tests/bench/fake_vllm`) with the few names and arguments the benches
use, over vllm_anatomy's engine, so that every path of the drivers runs on a CPU.
"""
import types

import vllm_anatomy

__version__ = "stand-in"


def SamplingParams(detokenize: bool = True, **kwargs):
    return vllm_anatomy.SamplingParams(**kwargs)


class LLM(vllm_anatomy.LLM):
    def __init__(self, model: str, *, load_format: str, skip_tokenizer_init: bool, enforce_eager: bool,
                 attention_backend: str, gpu_memory_utilization: float, **engine_args):
        super().__init__(model, **engine_args)
        self.llm_engine.vllm_config.compilation_config = types.SimpleNamespace(cudagraph_mode="NONE", mode=0)

import torch

from vllm_anatomy.model_executor.sampler import Sampler
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata


def _md(min_tokens):
    return SamplingMetadata(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
                            min_p=None, generators={}, max_num_logprobs=1, min_tokens=min_tokens)


def test_min_tokens_masks_stop_tokens_only_for_listed_rows():
    logits = torch.zeros(2, 8)
    logits[:, 2] = 5.0          # EOS (id 2) is the favourite of both rows
    logits[:, 5] = 4.0
    out = Sampler()(logits, _md({0: [2]}))
    assert out.sampled_token_ids.tolist() == [5, 2]
    # logprobs stay the model's raw distribution (vLLM's default "raw" mode)
    assert out.logprobs_tensors.logprob_token_ids[0, 1].item() == 2

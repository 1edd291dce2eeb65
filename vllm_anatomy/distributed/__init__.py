"""Tensor parallelism over torch.distributed (vLLM: vllm/distributed/)."""
from vllm_anatomy.distributed.communication_op import (tensor_model_parallel_all_gather,
                                                       tensor_model_parallel_all_reduce)
from vllm_anatomy.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                     get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size, get_tp_group,
                                                     get_world_group, init_distributed_environment,
                                                     initialize_model_parallel)

__all__ = ["tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce", "destroy_distributed_environment",
           "destroy_model_parallel", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
           "get_tp_group", "get_world_group", "init_distributed_environment", "initialize_model_parallel"]

"""Triton kernels (installed as vllm_anatomy.kernels); each beside its plain-torch reference.

One module is a library call instead: prefill_attention_sdpa.py (torch SDPA on cuDNN for
long fresh prefills, behind VLLM_ANATOMY_PREFILL_KERNEL=cudnn; its NOTE says why)."""

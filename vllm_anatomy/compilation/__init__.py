"""How the forward pass is turned into CUDA graphs (vllm/compilation/): here only the
breakable capture that gives piecewise graphs around eager attention, with no torch.compile."""

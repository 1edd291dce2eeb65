"""OpenAIServingModels: which model names this server answers to.

Mirrors vllm/entrypoints/openai/models/serving.py (OpenAIServingModels) and
models/protocol.py beside it (BaseModelPath). A request's `model` must be a
served model name or the model
path; anything else is a 404 `model_not_found`, as OpenAI answers. A request
without `model` means the first served name (vLLM accepts that too).
No LoRA adapters here, so the list is the base model(s) only.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_anatomy.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


@dataclass
class BaseModelPath:
    name: str
    model_path: str


class OpenAIServingModels:

    def __init__(self, base_model_paths: list[BaseModelPath], max_model_len: int) -> None:
        if not base_model_paths:
            raise ValueError("at least one served model name is needed")
        self.base_model_paths = base_model_paths
        self.max_model_len = max_model_len

    @property
    def model_name(self) -> str:
        """The name responses report (the first served model name)."""
        return self.base_model_paths[0].name

    def is_base_model(self, model_name: str | None) -> bool:
        if model_name is None:
            return True
        return any(model_name in (p.name, p.model_path) for p in self.base_model_paths)

    def model_name_for(self, requested: str | None) -> str:
        """The name to echo back in responses: what the client asked for, if it is served."""
        return requested if requested is not None else self.model_name

    async def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=p.name, root=p.model_path, max_model_len=self.max_model_len,
                           permission=[ModelPermission()])
                 for p in self.base_model_paths]
        return ModelList(data=cards)

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    return str(ensure_default_model())

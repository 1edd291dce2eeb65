"""Frontend metrics: per-iteration and per-finished-request statistics (vllm/v1/metrics/)."""
from vllm_anatomy.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats

__all__ = ["FinishedRequestStats", "IterationStats", "RequestStateStats"]

"""Serving across processes: a model cut into pipeline stages (`Stage`, one adapter per model family), stage
worker processes, and the head that schedules microbatches through them (`Pipeline`)."""

from .adapters import ADAPTERS, GPT2Adapter, LlamaAdapter, OPTAdapter, StageAdapter, adapter_for
from .batching import Result
from .pipeline import Pipeline
from .stage import Stage, position_ids

__all__ = ["ADAPTERS", "GPT2Adapter", "LlamaAdapter", "OPTAdapter", "Pipeline", "Result", "Stage", "StageAdapter",
           "adapter_for", "position_ids"]

"""Serving across processes: a model cut into pipeline stages (`Stage`, one adapter per model family)."""

from .adapters import ADAPTERS, GPT2Adapter, LlamaAdapter, OPTAdapter, StageAdapter, adapter_for
from .stage import Stage, position_ids

__all__ = ["ADAPTERS", "GPT2Adapter", "LlamaAdapter", "OPTAdapter", "Stage", "StageAdapter", "adapter_for",
           "position_ids"]

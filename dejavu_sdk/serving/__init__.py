"""Serving across processes: stage worker processes, each holding a stage of the model
(`dejavu_sdk.generation.Stage`), and the head that schedules requests through them (`Pipeline`)."""

from ..generation import (
           ADAPTERS,
           GPT2Adapter,
           LlamaAdapter,
           OPTAdapter,
           Result,
           Stage,
           StageAdapter,
           adapter_for,
           position_ids,
)
from .pipeline import Pipeline

__all__ = ["ADAPTERS", "GPT2Adapter", "LlamaAdapter", "OPTAdapter", "Pipeline", "Result", "Stage", "StageAdapter",
           "adapter_for", "position_ids"]

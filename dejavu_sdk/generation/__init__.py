"""Generating in microbatches, below both the one-process engine and the serving pipeline: a model cut into
stages (`Stage`, one adapter per model family), how each row picks its tokens (`decoding`), requests and
microbatches (`batching`), admission within a KV budget (`admission`), continuous batching's slots whose rows
come and go between steps (`slots`, with `replay` as its exact reference), and one process's scheduler
(`roundrobin`, behind `DejaVuEngine.generate_many`): slots stepped in turn, static batching one policy of them
and continuous batching the other."""

from .adapters import ADAPTERS, GPT2Adapter, LlamaAdapter, OPTAdapter, StageAdapter, adapter_for
from .batching import Result
from .replay import replay
from .slots import Round
from .stage import Stage, position_ids

__all__ = ["ADAPTERS", "GPT2Adapter", "LlamaAdapter", "OPTAdapter", "Result", "Round", "Stage", "StageAdapter",
           "adapter_for", "position_ids", "replay"]

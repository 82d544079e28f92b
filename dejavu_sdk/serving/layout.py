"""A pipeline's layout as plain data: its stages, their roles and layers, who links to whom, and the replica ring.

Mixed: one pipeline of stages that run prompts and tokens alike. Disaggregated: a prompt pipeline, then a token
pipeline, each cut into stages of its own. Stages are numbered by `index` in the order their workers are
assigned (prompt stages first), and named one way everywhere ("stage 1", "prompt stage 0", "token stage 1").
With recovery from replicas and no shared replica store, each decoding stage replicates into the next decoding
stage around a ring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import ConfigError
from ..generation.stage import check_layers
from ..stream import LayerPartition
from .wire.messages import Links


@attrs.frozen
class StageInfo:
    """One stage of the layout: its `name`, `role` ("mixed", "prompt" or "token"), `number` in its own pipeline,
    and `layers`."""

    name: str
    role: str
    number: int
    layers: tuple[int, int]

    @property
    def layer_count(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def decodes(self) -> bool:
        return self.role != "prompt"


@attrs.frozen
class Layout:
    """The stages of one pipeline (`pipelines`: one list of layer ranges, or the prompt and the token pipeline's),
    and whether decoding stages replicate around a `ring` (recovery from replicas without a replica store)."""

    pipelines: list[list[tuple[int, int]]]
    ring: bool = False
    stages: list[StageInfo] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        kinds = ("prompt", "token") if len(self.pipelines) == 2 else ("mixed",)
        object.__setattr__(self, "stages", [
            StageInfo(f"stage {number}" if kind == "mixed" else f"{kind} stage {number}", kind, number, layers)
            for kind, layout in zip(kinds, self.pipelines, strict=True) for number, layers in enumerate(layout)])

    @property
    def disaggregated(self) -> bool:
        return len(self.pipelines) == 2

    @property
    def layers(self) -> list[tuple[int, int]]:
        """Every stage's layers, by index."""
        return [stage.layers for stage in self.stages]

    @property
    def prompt_depth(self) -> int:
        """Stages that run prompts: the prompt pipeline's, or the mixed pipeline's."""
        return len(self.pipelines[0])

    @property
    def token_depth(self) -> int:
        """Stages that decode: the token pipeline's, or the mixed pipeline's."""
        return len(self.pipelines[-1])

    def decoding_stages(self) -> list[int]:
        """The stages that decode (mixed or token stages), in pipeline order."""
        return [index for index, stage in enumerate(self.stages) if stage.decodes]

    def replica_holder(self, index: int) -> int | None:
        """The stage holding decoding stage `index`'s replicas: the next decoding stage, around the ring."""
        decoding = self.decoding_stages()
        if not self.ring or index not in decoding:
            return None
        return decoding[(decoding.index(index) + 1) % len(decoding)]

    def index_of(self, stage: str | int) -> int:
        """A stage's index, from its name or its index (ConfigError for neither)."""
        if isinstance(stage, int) and 0 <= stage < len(self.stages):
            return stage
        for index, info in enumerate(self.stages):
            if info.name == stage:
                return index
        raise ConfigError(f"no stage {stage!r} in this layout")

    def links(self, index: int, urls: Sequence[str], replica_store: str | None, replica_prefix: str) -> Links:
        """Stage `index`'s links, given every stage's inbox (`urls`): the next stage of its pipeline, its pipeline's
        first stage, a prompt stage's token stages, and a decoding stage's replica holder or replica store."""
        stage = self.stages[index]
        pipeline = [other for other, info in enumerate(self.stages) if info.decodes == stage.decodes]
        following = pipeline[stage.number + 1] if stage.number + 1 < len(pipeline) else None
        token_stages: list[str] = []
        token_boundaries: list[int] = []
        if stage.role == "prompt":
            token_layout = self.pipelines[1]
            token_stages = [urls[other] for other in self.decoding_stages()]
            token_boundaries = [token_layout[0][0]] + [stop for _, stop in token_layout]
        holder = self.replica_holder(index)
        return Links(stage.layers, urls[pipeline[0]], None if following is None else urls[following],
                     token_stages, token_boundaries, None if holder is None else urls[holder],
                     replica_store if stage.decodes else None, replica_prefix)


def pipelines_for(stages: int | None, layers: Sequence[tuple[int, int]] | None, prompt_stages: int | None,
                  token_stages: int | None, total: int) -> list[list[tuple[int, int]]]:
    """The stages' layer ranges: one mixed pipeline (`layers`, or `stages` even cuts), or a prompt and a token
    pipeline of `prompt_stages` and `token_stages` even cuts each."""
    if prompt_stages is None and token_stages is None:
        return [_cuts(stages, layers, total)]
    if prompt_stages is None or token_stages is None:
        raise ConfigError("a disaggregated pipeline needs both prompt_stages= and token_stages=")
    if stages is not None or layers is not None:
        raise ConfigError("give stages=/layers= for one mixed pipeline, or prompt_stages= and token_stages= for "
                          "a disaggregated one, not both")
    return [_even(prompt_stages, total, "prompt_stages"), _even(token_stages, total, "token_stages")]


def _cuts(stages: int | None, layers: Sequence[tuple[int, int]] | None, total: int) -> list[tuple[int, int]]:
    """One pipeline's layer ranges: `layers` as given (contiguous from 0 to the last layer), or `stages` even
    cuts."""
    if layers is not None:
        cuts = [check_layers(pair, total) for pair in layers]
        ends = [0] + [stop for _, stop in cuts]
        if not cuts or [start for start, _ in cuts] != ends[:-1] or ends[-1] != total:
            raise ConfigError(f"layers={list(layers)!r} must cover the model's {total} layers in order, each "
                              "stage starting where the previous ends")
        if stages is not None and stages != len(cuts):
            raise ConfigError(f"stages={stages} but layers lists {len(cuts)} stages")
        return cuts
    return _even(1 if stages is None else stages, total, "stages")


def _even(stages: Any, total: int, name: str) -> list[tuple[int, int]]:
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ConfigError(f"{name} must be an integer from 1 to the model's {total} layers, got {stages!r}")
    return LayerPartition.even(total, stages).stages

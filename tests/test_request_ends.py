"""A request's own ends: `stop_token_ids` (its row ends at any), `ignore_eos`, and `min_tokens` (its end ids masked
until then), equal to `model.generate` with the same end ids and `min_new_tokens`, in static and continuous
batching."""

from __future__ import annotations

import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.decoding import Decoding

MAX_NEW = 12


def _generate(model, prompt: torch.Tensor, eos: list[int] | None, min_new: int = 0) -> list[int]:
    """`model.generate` alone on `prompt`, ending at `eos` (None: never), cut after its first end id."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, min_new_tokens=min_new,
                         pad_token_id=0)[0, prompt.numel():].tolist()
    end = next((index for index, token in enumerate(out) if eos and token in eos), None)
    return out if end is None else out[:end + 1]


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_stop_token_ids_ignore_eos_and_min_tokens_equal_generate(batching) -> None:
    model = tiny_models.llama()
    prompt = torch.tensor([5, 17, 33, 8, 61])
    plain = _generate(model, prompt, None)
    stop = plain[2]  # the third token: a stop id there ends the row after three tokens
    model.generation_config.eos_token_id = plain[4]  # and the model's own end comes at the fifth
    eos = [plain[4]]
    cases = [({}, _generate(model, prompt, eos)),
             ({"stop_token_ids": [stop]}, _generate(model, prompt, [*eos, stop])),
             ({"ignore_eos": True}, plain),
             ({"ignore_eos": True, "stop_token_ids": [stop]}, _generate(model, prompt, [stop])),
             ({"stop_token_ids": [stop], "min_tokens": 6}, _generate(model, prompt, [*eos, stop], min_new=6))]
    assert len({len(want) for _, want in cases}) >= 3  # the ends differ
    engine = dv.DejaVuEngine(model)
    results = [engine.generate_many([prompt], MAX_NEW, batching=batching, swapping=False, **ends)[0]
               for ends, _ in cases]
    assert [result.tokens.tolist() for result in results] == [want for _, want in cases]


def test_bad_ends_are_config_errors() -> None:
    for ends in ({"stop_token_ids": [-1]}, {"stop_token_ids": "5"}, {"min_tokens": -1}, {"min_tokens": True},
                 {"ignore_eos": "yes"}):
        with pytest.raises(dv.ConfigError):
            Decoding.of(**ends)
    assert Decoding.of(stop_token_ids=[7, 3, 7]).ends.stop_token_ids == (3, 7)

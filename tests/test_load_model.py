"""`load_model`: a model spec loaded whole, or as the skeleton a head checks (`weights=False`): the same modules,
config and generation config as the loaded model, with no weight read and no memory held; the pipeline's checks
take the skeleton."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama

from dejavu_sdk.generation.decoding import TokenRules
from dejavu_sdk.models import load_model
from dejavu_sdk.serving.options import PipelineOptions


def test_a_skeleton_is_the_loaded_model_without_its_weights(tmp_path) -> None:
    source = llama()
    source.generation_config.eos_token_id = [3, 5]  # saved beside the config, read back by both
    source.save_pretrained(tmp_path / "tiny")
    whole, skeleton = load_model(str(tmp_path / "tiny")), load_model(str(tmp_path / "tiny"), weights=False)
    assert {parameter.device.type for parameter in skeleton.parameters()} == {"meta"}
    assert [(name, parameter.shape, parameter.dtype) for name, parameter in skeleton.named_parameters()] == \
        [(name, parameter.shape, parameter.dtype) for name, parameter in whole.named_parameters()]
    assert skeleton.generation_config.to_dict() == whole.generation_config.to_dict()
    assert TokenRules.of(skeleton) == TokenRules.of(whole)
    assert TokenRules.of(skeleton).eos == [3, 5]
    assert not skeleton.training
    torch.testing.assert_close(whole.lm_head.weight, source.lm_head.weight)


def test_the_pipelines_checks_read_no_weights_unless_a_kv_budget_leaves_a_choice(tmp_path, monkeypatch) -> None:
    llama().save_pretrained(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the checks read the weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    for recovery in ("recompute", None):  # swapping="auto" without a KV budget: nothing to measure
        options = PipelineOptions.check(str(tmp_path / "tiny"), 2, recovery=recovery)
        assert options.memory.kv_bytes_per_token > 0
    tight = options.memory.kv_bytes_per_token * 1000  # two slots, not every microbatch: the device the weights load on
    with pytest.raises(AssertionError, match="read the weights"):
        PipelineOptions.check(str(tmp_path / "tiny"), 2, kv_budget_bytes=tight, microbatch=4)  # (the default fits)

"""The planner's formulas against hand-computed cases, its edge cases, and its errors."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import attrs
import pytest

import dejavu_sdk as dv
from dejavu_sdk.planner import (
    MemoryModel,
    baseline_inverse_throughput,
    continuous_split,
    disaggregated_inverse_throughput,
    payoff_threshold,
    plan,
    swapping_pays_off,
)
from dejavu_sdk.profiles import Roofline, hardware_profile, model_profile, profile_from_hf_config


def test_a_hand_computed_plan() -> None:
    # D=8, Y=1, t=0.02, N=200, m=1: I_c = 7 * 0.98 / 8 + 1 + 4 = 5.8575.
    # Splits: 1+7 -> max(8, 32/7) = 8; 2+6 -> max(4, 32/6) = 5.333; 3+5 -> max(2.667, 6.4) = 6.4.
    result = plan(8, prompt_time=1.0, token_time=0.02, new_tokens=200)
    assert result.baseline_inverse_throughput == pytest.approx(5.8575)
    assert (result.disaggregate, result.prompt_machines, result.token_machines) == (True, 2, 6)
    assert result.disaggregated_inverse_throughput == pytest.approx(32 / 6)
    assert result.predicted_speedup == pytest.approx(5.8575 / (32 / 6))
    assert result.threshold == pytest.approx(1.0)
    assert "Disaggregate into 2 prompt + 6 token machines" in result.reason
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        result.disaggregate = False  # type: ignore[misc]


def test_when_prefill_is_no_slower_than_a_token_the_mixed_pipeline_stays() -> None:
    result = plan(8, prompt_time=0.03, token_time=0.03, new_tokens=200)
    assert not result.disaggregate
    assert (result.prompt_machines, result.token_machines) == (0, 0)
    assert result.predicted_speedup < 1
    assert result.reason.startswith("Keep one mixed pipeline")
    assert "does not exceed" in result.reason


def test_the_continuous_split_balances_both_pipelines() -> None:
    prompt, token = continuous_split(10, prompt_time=2.0, token_time=0.01, new_tokens=300, stream_overhead=1.2)
    assert prompt + token == pytest.approx(10)
    assert prompt == pytest.approx(10 * 2.4 / (2.4 + 3.0))
    assert disaggregated_inverse_throughput(prompt, token, 2.0, 0.01, 300, 1.2) == pytest.approx(2.4 + 3.0)


@pytest.mark.parametrize(("machines", "overhead"), list(itertools.product([2, 3, 5, 8, 16], [1.0, 1.1, 1.3, 1.45])))
def test_the_payoff_condition_is_exactly_where_the_balanced_split_beats_the_baseline(machines: int,
                                                                                     overhead: float) -> None:
    threshold = payoff_threshold(machines, overhead)
    token_time, new_tokens = 0.01, 100
    for ratio in (0.5 * threshold, 0.99 * threshold, 1.01 * threshold, 3 * threshold):
        if not math.isfinite(ratio):
            continue
        prompt_time = ratio * token_time
        split = continuous_split(machines, prompt_time, token_time, new_tokens, overhead)
        balanced = disaggregated_inverse_throughput(*split, prompt_time, token_time, new_tokens, overhead)
        baseline = baseline_inverse_throughput(machines, prompt_time, token_time, new_tokens)
        assert (balanced < baseline) == (ratio > threshold), (ratio, threshold)


def test_the_threshold_is_infinite_where_no_split_can_pay_off() -> None:
    assert payoff_threshold(2, 1.5) == math.inf  # D (2 - m) - 1 = 0
    assert payoff_threshold(8, 1.0) == pytest.approx(1.0)
    assert payoff_threshold(4, 1.5) == pytest.approx(3.0)


def test_memory_bounds_by_hand() -> None:
    roomy = MemoryModel(memory_per_machine=100, layers=10, weight_bytes_per_layer=5, prompt_cache_bytes_per_layer=2,
                        token_cache_bytes_per_layer=1)
    assert (roomy.min_prompt_machines, roomy.min_token_machines) == (1, 1)
    tight = MemoryModel(memory_per_machine=40, layers=10, weight_bytes_per_layer=5, prompt_cache_bytes_per_layer=1,
                        token_cache_bytes_per_layer=1)
    assert tight.min_prompt_machines == 2  # ceil(10 * 6 / 40)
    assert tight.min_token_machines == 3  # ceil(10 * 5 / (40 - 20)) = ceil(2.5)
    too_few = plan(4, 1.0, 0.02, 200, memory=tight)
    assert not too_few.disaggregate
    assert "for memory" in too_few.reason
    # Without bounds 1 prompt + 7 token machines pays off (I_dis = 4.571 < I_c = 4.92); memory forces at
    # least 2 prompt machines, and 2 + 6 gives I_dis = 5.333, worse than the mixed pipeline.
    assert (plan(8, 0.5, 0.02, 200).prompt_machines, plan(8, 0.5, 0.02, 200).token_machines) == (1, 7)
    bounded = plan(8, 0.5, 0.02, 200, memory=tight)
    assert not bounded.disaggregate
    assert "(2 prompt + 6 token machines)" in bounded.reason


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(machines=1), "at least 2"),
    (dict(machines=0), "at least 2"),
    (dict(machines=2.5), "at least 2"),
    (dict(machines=True), "at least 2"),
    (dict(stream_overhead=2.0), "stream_overhead must be in [1, 2)"),
    (dict(stream_overhead=0.9), "stream_overhead must be in [1, 2)"),
    (dict(prompt_time=0.0), "prompt_time must be a positive number"),
    (dict(token_time=-1.0), "token_time must be a positive number"),
    (dict(prompt_time=math.nan), "prompt_time must be a positive number"),
    (dict(new_tokens=0), "new_tokens must be a positive number"),
    (dict(memory=MemoryModel(10, 10, 5, 0.5, 0.5)), "does not fit on 8 machines"),
    (dict(memory=MemoryModel(100, 10, 80, 1, 1)), "does not fit on 8 machines"),
])
def test_impossible_inputs_say_what_to_change(arguments: dict, message: str) -> None:
    call = dict(machines=8, prompt_time=1.0, token_time=0.02, new_tokens=200) | arguments
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        plan(**call)


def test_bad_memory_models_are_refused() -> None:
    with pytest.raises(dv.ConfigError, match="layers"):
        MemoryModel(100, 0, 5)
    with pytest.raises(dv.ConfigError, match="memory_per_machine"):
        MemoryModel(-1, 10, 5)
    with pytest.raises(dv.ConfigError, match="prompt_cache_bytes_per_layer"):
        MemoryModel(100, 10, 5, prompt_cache_bytes_per_layer=-1)


def test_the_swapping_condition_by_hand() -> None:
    # N=2, p=0, t=1, B=1, C=1: transf_i = i / bw. With bw=1: 1 + 1 + 2 = 4 <= 2 N t = 4.
    assert swapping_pays_off(2, 0, 1.0, 1, 1.0, host_bandwidth=1.0)
    # With bw=0.5: 1 + 2 + 4 = 7 > 4.
    assert not swapping_pays_off(2, 0, 1.0, 1, 1.0, host_bandwidth=0.5)
    # Long sequences make the swap-in dominate.
    assert swapping_pays_off(100, 10, 0.03, 8, 36864 * 16, host_bandwidth=25e9)
    assert not swapping_pays_off(100, 4000, 0.03, 8, 36864 * 16, host_bandwidth=25e9)
    with pytest.raises(dv.ConfigError, match="batch"):
        swapping_pays_off(2, 0, 1.0, 0, 1.0, 1.0)
    with pytest.raises(dv.ConfigError, match="host_bandwidth"):
        swapping_pays_off(2, 0, 1.0, 1, 1.0, 0)


def test_profiles_and_a_roofline_estimate() -> None:
    opt = model_profile("OPT-66B")
    assert opt.layers == 64
    assert opt.kv_bytes_per_token_per_layer == 2 * 9216 * 2
    assert opt.weight_bytes == pytest.approx(131.4e9)
    roofline = Roofline(opt, hardware_profile("a100-80gb"), gpus=4)
    assert roofline.machine_memory == 320e9
    assert roofline.prompt_time(8, 1000) == pytest.approx(2 * 65.7e9 * 8000 / (4 * 312e12 * 0.5))
    assert roofline.token_time(8, 1000) > opt.weight_bytes / (4 * 2.039e12)  # reads every weight at least
    with pytest.raises(dv.ConfigError, match="choose from"):
        model_profile("gpt-5")
    with pytest.raises(dv.ConfigError, match="choose from"):
        hardware_profile("tpu")


def test_a_hugging_face_config_gives_the_parameter_count(tmp_path) -> None:
    # SmolLM2-135M's published configuration: 134.5M parameters, grouped-query attention with 3 KV heads.
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536, "vocab_size": 49152, "hidden_act": "silu", "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = profile_from_hf_config(str(tmp_path))
    assert profile.layers == 30
    assert profile.parameters == pytest.approx(134.5e6, rel=0.01)
    assert profile.kv_bytes_per_token_per_layer == 2 * 3 * 64 * 2
    (tmp_path / "bad.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(dv.ConfigError, match="layer count"):
        profile_from_hf_config(str(tmp_path / "bad.json"))
    with pytest.raises(dv.ConfigError, match="cannot read"):
        profile_from_hf_config(str(tmp_path / "missing.json"))


def test_the_planner_guide_examples_run() -> None:
    guide = (Path(__file__).parent.parent / "docs" / "planner.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL)
    assert blocks
    for index, code in enumerate(blocks):
        exec(compile(code, f"docs/planner.md example {index + 1}", "exec"), {})

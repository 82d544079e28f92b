"""The planner: should D machines be split into prompt (P) and token (T) pipelines, and how?

The formulas of the DejaVu paper (Strati et al., ICML 2024, section 4 and appendix), for D machines of
memory M each and a model of L layers with per-layer weights W0, per-layer prompt cache C0 and per-layer
token cache K0 (bytes, for one microbatch), prompt time Y and per-token time t (seconds, one microbatch
on the whole model), N generated tokens and a streaming overhead factor m in [1, 2):

    prompt pipeline depth       D_p >= ceil(L (C0 + W0) / M)
    token pipeline depth        D_t >= L W0 / (M - L (C0 + K0))
    mixed baseline              I_c   = (D - 1)(Y - t) / D + Y + N t
    disaggregated               I_dis = max(I_p, I_t),  I_p = D m Y / D_p,  I_t = D N t / D_t
    best continuous split       D_p = D m Y / (m Y + N t),  D_t = D N t / (m Y + N t)
    disaggregation pays off     Y / t > (D - 1) / (D (2 - m) - 1)

I is an inverse throughput: time per microbatch with the D machines kept busy, so a smaller I is
better and I_c / I_dis is the predicted speed-up. `plan` searches the integer splits within the memory
bounds; `swapping_pays_off` is the appendix's condition for microbatch swapping.
"""

from __future__ import annotations

import math

import attrs

from .errors import ConfigError


@attrs.frozen
class MemoryModel:
    """What one microbatch needs in memory, per layer, and what each machine has (all in bytes)."""

    memory_per_machine: float
    layers: int
    weight_bytes_per_layer: float
    prompt_cache_bytes_per_layer: float = 0.0
    token_cache_bytes_per_layer: float = 0.0

    def __attrs_post_init__(self) -> None:
        for name in ("memory_per_machine", "weight_bytes_per_layer"):
            _require_positive(name, getattr(self, name))
        if not isinstance(self.layers, int) or self.layers < 1:
            raise ConfigError(f"layers must be a positive integer, got {self.layers!r}")
        for name in ("prompt_cache_bytes_per_layer", "token_cache_bytes_per_layer"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be zero or more, got {getattr(self, name)!r}")

    @property
    def min_prompt_machines(self) -> int:
        """D_p >= ceil(L (C0 + W0) / M): the prompt pipeline holds weights and one prompt's cache."""
        return max(1, math.ceil(self.layers * (self.prompt_cache_bytes_per_layer + self.weight_bytes_per_layer)
                                / self.memory_per_machine))

    @property
    def min_token_machines(self) -> int | None:
        """D_t >= L W0 / (M - L (C0 + K0)); None when one machine cannot even hold a microbatch's cache."""
        spare = self.memory_per_machine - self.layers * (self.prompt_cache_bytes_per_layer
                                                         + self.token_cache_bytes_per_layer)
        if spare <= 0:
            return None
        return max(1, math.ceil(self.layers * self.weight_bytes_per_layer / spare))


@attrs.frozen
class Plan:
    """The planner's answer. Times are inverse throughputs in the units of `prompt_time`."""

    disaggregate: bool
    prompt_machines: int
    token_machines: int
    predicted_speedup: float
    reason: str
    baseline_inverse_throughput: float
    disaggregated_inverse_throughput: float
    threshold: float  # Y/t must exceed this for disaggregation to pay off (inf: it never can)


def baseline_inverse_throughput(machines: int, prompt_time: float, token_time: float, new_tokens: float) -> float:
    """I_c = (D - 1)(Y - t) / D + Y + N t: one pipeline over all machines, prompts and tokens mixed."""
    d = machines
    return (d - 1) * (prompt_time - token_time) / d + prompt_time + new_tokens * token_time


def disaggregated_inverse_throughput(prompt_machines: int, token_machines: int, prompt_time: float,
                                     token_time: float, new_tokens: float, stream_overhead: float = 1.0) -> float:
    """I_dis = max(D m Y / D_p, D N t / D_t) for a split into D_p prompt and D_t token machines."""
    d = prompt_machines + token_machines
    return max(d * stream_overhead * prompt_time / prompt_machines, d * new_tokens * token_time / token_machines)


def continuous_split(machines: int, prompt_time: float, token_time: float, new_tokens: float,
                     stream_overhead: float = 1.0) -> tuple[float, float]:
    """The real-valued (D_p, D_t) that balances both pipelines: I_p = I_t."""
    prompt_work, token_work = stream_overhead * prompt_time, new_tokens * token_time
    return (machines * prompt_work / (prompt_work + token_work), machines * token_work / (prompt_work + token_work))


def payoff_threshold(machines: int, stream_overhead: float = 1.0) -> float:
    """(D - 1) / (D (2 - m) - 1): Y/t above it makes disaggregation faster; inf when nothing can."""
    denominator = machines * (2 - stream_overhead) - 1
    return math.inf if denominator <= 0 else (machines - 1) / denominator


def depth_bounds(machines: int, memory: MemoryModel | None) -> tuple[int, int]:
    """The fewest prompt and token machines that memory allows; ConfigError when the model cannot fit."""
    if memory is None:
        return 1, 1
    min_token = memory.min_token_machines
    if min_token is None or min_token > machines:
        raise ConfigError(
            f"the model does not fit on {machines} machines of {memory.memory_per_machine / 2**30:.1f} GiB "
            "with one microbatch's cache per stage: add machines, use machines with more memory, or "
            "shrink the microbatch (its cache) or the sequence length")
    return memory.min_prompt_machines, min_token


def best_split(machines: int, prompt_time: float, token_time: float, new_tokens: float,
               stream_overhead: float = 1.0, *, memory: MemoryModel | None = None) -> tuple[int, int] | None:
    """The integer (D_p, D_t) with the least I_dis within the memory bounds, whether or not it pays off;
    None when no split fits. Ties go to fewer prompt machines."""
    min_prompt, min_token = depth_bounds(machines, memory)
    splits = [(p, machines - p) for p in range(min_prompt, machines - min_token + 1)]
    if not splits:
        return None
    return min(splits, key=lambda split: (disaggregated_inverse_throughput(
        split[0], split[1], prompt_time, token_time, new_tokens, stream_overhead), split))


def plan(machines: int, prompt_time: float, token_time: float, new_tokens: float, stream_overhead: float = 1.0,
         *, memory: MemoryModel | None = None) -> Plan:
    """Choose between one mixed pipeline and the best prompt/token split of `machines` machines.

    `prompt_time` (Y) is one microbatch's prefill and `token_time` (t) one decode step, both on the whole
    model; `new_tokens` (N) is how many tokens a request generates; `stream_overhead` (m) is how much
    slower prefill runs while streaming its KV cache. `memory`, when given, bounds both pipelines' depths.
    """
    _check_inputs(machines, prompt_time, token_time, new_tokens, stream_overhead)
    baseline = baseline_inverse_throughput(machines, prompt_time, token_time, new_tokens)
    threshold = payoff_threshold(machines, stream_overhead)
    split = best_split(machines, prompt_time, token_time, new_tokens, stream_overhead, memory=memory)
    if split is None:
        min_prompt, min_token = depth_bounds(machines, memory)
        return Plan(False, 0, 0, 1.0, f"Keep one mixed pipeline: the prompt pipeline needs {min_prompt} and the "
                    f"token pipeline {min_token} machines for memory, more than the {machines} there are.",
                    baseline, math.inf, threshold)
    disaggregated = disaggregated_inverse_throughput(*split, prompt_time, token_time, new_tokens, stream_overhead)
    speedup = baseline / disaggregated
    pays = speedup > 1
    split_text = f"{split[0]} prompt + {split[1]} token machines"
    ratio = prompt_time / token_time
    condition = (f"Y/t = {ratio:.3g} {'exceeds' if ratio > threshold else 'does not exceed'} the threshold "
                 f"(D-1)/(D(2-m)-1) = {threshold:.3g}")
    if pays:
        reason = f"Disaggregate into {split_text}: {condition}; predicted {speedup:.2f}x the mixed pipeline."
    else:
        reason = (f"Keep one mixed pipeline: {condition}; the best split ({split_text}) would run at "
                  f"{speedup:.2f}x.")
    return Plan(pays, split[0] if pays else 0, split[1] if pays else 0, speedup, reason, baseline, disaggregated,
                threshold)


def swapping_pays_off(new_tokens: int, prompt_tokens: int, token_time: float, batch: int,
                      cache_bytes_per_token: float, host_bandwidth: float) -> bool:
    """Microbatch swapping keeps up while 2 N t >= sum_{i=p}^{N+p} max(t, transf_i).

    transf_i = i B C / bw is the time to bring back a cache of i tokens of a batch of B requests, with C
    bytes of cache per token (all layers of the stage) over a host link of `host_bandwidth` bytes/s.
    """
    for name, count in (("new_tokens", new_tokens), ("batch", batch)):
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"{name} must be a positive integer, got {count!r}")
    if not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise ConfigError(f"prompt_tokens must be zero or a positive integer, got {prompt_tokens!r}")
    for name, value in (("token_time", token_time), ("cache_bytes_per_token", cache_bytes_per_token),
                        ("host_bandwidth", host_bandwidth)):
        _require_positive(name, value)
    swap_in = sum(max(token_time, i * batch * cache_bytes_per_token / host_bandwidth)
                  for i in range(prompt_tokens, new_tokens + prompt_tokens + 1))
    return 2 * new_tokens * token_time >= swap_in


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


def _check_inputs(machines: int, prompt_time: float, token_time: float, new_tokens: float,
                  stream_overhead: float) -> None:
    if not isinstance(machines, int) or isinstance(machines, bool) or machines < 2:
        raise ConfigError(f"machines must be an integer of at least 2, got {machines!r}: a split needs one prompt "
                          "and one token machine")
    for name, value in (("prompt_time", prompt_time), ("token_time", token_time), ("new_tokens", new_tokens)):
        _require_positive(name, value)
    if not isinstance(stream_overhead, (int, float)) or not 1 <= stream_overhead < 2:
        raise ConfigError(f"stream_overhead must be in [1, 2), got {stream_overhead!r}: it is how much slower "
                          "prefill runs while streaming (1.0: no slowdown); at 2 or more a split never pays off")

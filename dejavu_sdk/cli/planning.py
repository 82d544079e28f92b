"""`dejavu plan` and `dejavu simulate`: the planner and the serving simulator from the command line.

Both need the prompt time Y and per-token time t of one microbatch, from one of:
    --prompt-time/--token-time        given in seconds
    --model + --hardware              a roofline estimate for a built-in or Hugging Face model
    --measure MODEL                   timed on this machine (`smollm2` or a local model directory)
With --model and --hardware the planner also knows the memory bounds of both pipelines. The answers come from
`dejavu_sdk.planner` (plan) and `dejavu_sdk.sweep` over `dejavu_sdk.simulator` (simulate).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import attrs

from ..errors import ConfigError
from ..planner import MemoryModel, plan
from ..profiles import ModelProfile, Roofline, hardware_profile, model_profile, profile_from_hf_config
from ..traces import load_trace
from .output import add_output_arguments, write_outputs


@attrs.frozen
class Inputs:
    prompt_time: float
    token_time: float
    source: str
    memory: MemoryModel | None


def _model(name: str) -> ModelProfile:
    return profile_from_hf_config(name) if os.path.exists(name) else model_profile(name)


def resolve_inputs(args: argparse.Namespace, new_tokens: float) -> Inputs:
    """Y, t (and memory bounds when the hardware is known) from whichever source the arguments give."""
    _check_positive(args, "microbatch", "prompt_tokens", "gpus_per_machine")
    given = args.prompt_time is not None or args.token_time is not None
    if given and (args.prompt_time is None or args.token_time is None):
        raise ConfigError("give both --prompt-time and --token-time (seconds), or neither")
    if sum([given, args.measure is not None, args.model is not None and not given]) == 0:
        raise ConfigError("say how fast the model is: --prompt-time and --token-time, or --model and --hardware "
                          "for an estimate, or --measure MODEL to time it here")
    memory = None
    roofline = None
    if args.model is not None:
        if args.hardware is None:
            raise ConfigError("--model needs --hardware (one of a100-80gb, v100-16gb, h200) for the machines' memory")
        roofline = Roofline(_model(args.model), hardware_profile(args.hardware), gpus=args.gpus_per_machine)
        model = roofline.model
        memory = MemoryModel(roofline.machine_memory, model.layers, model.weight_bytes_per_layer,
                             model.cache_bytes_per_layer(args.microbatch, args.prompt_tokens),
                             model.cache_bytes_per_layer(args.microbatch, max(1, round(new_tokens))))
    if given:
        return Inputs(args.prompt_time, args.token_time, "given", memory)
    if args.measure is not None:
        from ..timing import load_causal_lm, measure_times

        prompt_time, token_time = measure_times(load_causal_lm(args.measure), args.microbatch, args.prompt_tokens)
        return Inputs(prompt_time, token_time, f"measured here on {args.measure}", memory)
    assert roofline is not None  # neither given nor measured, so --model was (checked above)
    context = args.prompt_tokens + round(new_tokens / 2)
    return Inputs(roofline.prompt_time(args.microbatch, args.prompt_tokens),
                  roofline.token_time(args.microbatch, context),
                  f"roofline estimate for {roofline.model.name} on {args.gpus_per_machine}x {roofline.hardware.name}",
                  memory)


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _plan(args: argparse.Namespace) -> int:
    new_tokens = args.new_tokens if args.new_tokens is not None else float(load_trace().output_tokens.mean())
    inputs = resolve_inputs(args, new_tokens)
    result = plan(args.machines, inputs.prompt_time, inputs.token_time, new_tokens, args.stream_overhead,
                  memory=inputs.memory)
    if args.json:
        print(json.dumps({"inputs": {"prompt_time": inputs.prompt_time, "token_time": inputs.token_time,
                                     "new_tokens": new_tokens, "source": inputs.source},
                          "plan": attrs.asdict(result)}, indent=1))
        return 0
    print(f"Y = {inputs.prompt_time * 1e3:.1f} ms prefill, t = {inputs.token_time * 1e3:.2f} ms per token "
          f"({inputs.source}); N = {new_tokens:.0f} new tokens; m = {args.stream_overhead}")
    if inputs.memory is not None:
        print(f"memory bounds: at least {inputs.memory.min_prompt_machines} prompt and "
              f"{inputs.memory.min_token_machines} token machines")
    print(result.reason)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from ..simulator import Workload, poisson_arrivals
    from ..sweep import plot_sweep, run_sweep, sweep_markdown

    machine_counts = _machine_range(args.machines)
    trace = load_trace(args.trace)
    lengths = trace.sample_output_lengths(args.requests, seed=args.seed)
    probe = Workload(1.0, 1.0, lengths, (0.0,) * len(lengths), args.microbatch)
    inputs = resolve_inputs(args, probe.steps_per_microbatch)
    workload = Workload(inputs.prompt_time, inputs.token_time, lengths,
                        poisson_arrivals(args.requests, args.rate, seed=args.seed), args.microbatch,
                        args.stream_overhead)
    arrivals = "all at once" if args.rate is None else f"Poisson at {args.rate} requests/s"
    title = (f"{args.requests} requests ({arrivals}), microbatches of {args.microbatch}, prompt "
             f"{args.prompt_tokens} tokens, output lengths from {trace.name}"
             f"{f' ({trace.attribution})' if trace.attribution else ''}; "
             f"Y = {inputs.prompt_time:.3g} s, t = {inputs.token_time:.3g} s ({inputs.source}); "
             f"m = {args.stream_overhead}")
    sweep = run_sweep(workload, machine_counts, inputs.memory, title, progress=not args.quiet)
    print(sweep_markdown(sweep))
    write_outputs(args, sweep, lambda path: plot_sweep(sweep, path))
    return 0


def _machine_range(text: str) -> list[int]:
    """`1-16` or `2,4,8`: machine counts to sweep."""
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-"))
            counts = list(range(low, high + 1))
        else:
            counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--machines takes a range like 1-16 or a list like 2,4,8, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--machines needs at least one machine count of 1 or more, got {text!r}")
    return counts


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("how fast the model is (one of)")
    source.add_argument("--prompt-time", type=float, help="Y: seconds to prefill one microbatch")
    source.add_argument("--token-time", type=float, help="t: seconds per decode step of one microbatch")
    source.add_argument("--model", help="opt-13b, opt-30b, opt-66b, bloom-176b, or a Hugging Face config.json "
                        "(with --hardware: a roofline estimate and memory bounds)")
    source.add_argument("--hardware", help="a100-80gb, v100-16gb or h200")
    source.add_argument("--gpus-per-machine", type=int, default=1, help="accelerators per machine (default 1)")
    source.add_argument("--measure", metavar="MODEL", help="time prefill and one decode step here: 'smollm2' or "
                        "a local model directory")
    parser.add_argument("--microbatch", type=int, default=8, help="requests per microbatch (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length (default 1000, as the "
                        "paper)")
    parser.add_argument("--stream-overhead", type=float, default=1.0, help="m in [1, 2): how much slower prefill "
                        "runs while streaming its KV cache (default 1.0)")


def add_planning_commands(commands: Any) -> None:
    """Register `plan` and `simulate` on the `dejavu` command's subparsers."""
    planner = commands.add_parser("plan", help="should prompt and token work run on separate machines, and how "
                                  "many of each?")
    planner.add_argument("--machines", type=int, required=True, help="machines to split (at least 2)")
    planner.add_argument("--new-tokens", type=float, help="tokens each request generates (default: the mean of "
                         "the shipped Azure conversation trace)")
    planner.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_model_arguments(planner)
    planner.set_defaults(run=_plan)

    simulate = commands.add_parser("simulate", help="simulate pipeline, pipeline+dp and disaggregated serving over "
                                   "a range of machine counts")
    simulate.add_argument("--machines", default="1-16", help="machine counts: a range like 1-16 or a list 2,4,8")
    simulate.add_argument("--requests", type=int, default=1000, help="requests to serve (default 1000)")
    simulate.add_argument("--rate", type=float, help="Poisson arrivals per second (default: all at once)")
    simulate.add_argument("--trace", help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens for output lengths "
                          "(default: the shipped Azure LLM 2023 conversation sample, CC-BY-4.0)")
    simulate.add_argument("--seed", type=int, default=0)
    add_output_arguments(simulate, samples="the outcomes", figures="makespan and cost")
    _add_model_arguments(simulate)
    simulate.set_defaults(run=_simulate)

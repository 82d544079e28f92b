"""Every option of the serving core with every other: batching x recovery x layout x swapping x decoding x model
family, through `dv.Pipeline`.

Each cell serves six requests of its decoding and checks every token: static microbatches against
`model.generate` on each microbatch with each row drawn its own way (`expectations.replayed`), continuous slots
against the replay of the schedule each result carries. Where recovery is on, each decoding stage in turn is
SIGKILLed while a new set of requests decodes (the first token stage, then the last stage, where they differ),
and every request is checked again the same way: exact, none lost. A cell that the pipeline refuses must give one
of the documented reasons (`REFUSALS`, listed in docs/serving.md).

The slow tier runs a pairwise covering set (every pair of option values in some cell); `pytest -m matrix` runs the
whole product. `python tests/test_matrix.py` prints the last table for docs/serving.md.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator

import expectations
import pytest
import tiny_models
import torch

import dejavu_sdk as dv
from dejavu_sdk.generation.batching import Request
from dejavu_sdk.generation.decoding import Decoding, TokenRules
from dejavu_sdk.generation.replay import replay
from dejavu_sdk.serving import Pipeline

pytestmark = pytest.mark.usefixtures("workers_import_tiny_models")

FACTORS: dict[str, list] = {
    "batching": ["continuous", "static"],
    "recovery": [None, "recompute", "replicas", "replicas+store"],
    "layout": ["one stage", "mixed", "disaggregated"],
    "swapping": [False, True],
    "decoding": ["greedy", "sampled", "logprobs", "stop", "n"],
    "family": ["llama", "mistral", "qwen2_sliding"],
}
LAYOUTS = {"one stage": {"stages": 1}, "mixed": {"stages": 2}, "disaggregated": {"prompt_stages": 1, "token_stages": 2}}
#: Why a cell may be refused, by a fragment of the ConfigError (docs/serving.md lists them).
REFUSALS = {
    "two decoding stages": "a stage's replica is kept on the next decoding stage: one decoding stage has no next",
}
LIMITS = [9, 4, 7, 3, 8, 6]
#: The requests a stage is killed beside: long enough that the kill comes while they decode.
LONGER = [30, 20, 26, 16, 30, 24]
STOP = 50  # a stop token id for the "stop" decoding


def _cell_id(cell: dict) -> str:
    return "-".join(str(value).replace(" ", "_") for value in cell.values())


def pairwise(factors: dict[str, list]) -> list[dict]:
    """A small set of cells in which every pair of values of two factors appears in some cell (greedy: each new
    cell takes, factor by factor, the value that covers most pairs not yet covered)."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]}
    cells: list[dict] = []
    while uncovered:
        (first, value), (second, other) = min(uncovered, key=repr)  # deterministic
        cell = {first: value, second: other}
        for name in names:
            if name in cell:
                continue
            cell[name] = max(factors[name], key=lambda candidate: sum(
                ((a, cell[a]), (name, candidate)) in uncovered or ((name, candidate), (a, cell[a])) in uncovered
                for a in cell))
        cell = {name: cell[name] for name in names}
        uncovered -= {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(names, 2)}
        cells.append(cell)
    return cells


def _decodings(decoding: str) -> list[dict]:
    """Each request's decoding for the cell's kind."""
    if decoding == "sampled":
        return [{"do_sample": True, "seed": 100 + index, "top_k": 20} if index % 2 else {} for index in range(6)]
    if decoding == "logprobs":
        return [{"logprobs": 2} if index % 2 else {} for index in range(6)]
    if decoding == "stop":
        return [{"stop_token_ids": [STOP, 7 + index]} for index in range(6)]
    if decoding == "n":  # the last three: one prompt's three sampled choices
        return [{}] * 3 + [{"do_sample": True, "seed": 200 + index, "top_k": 20} for index in range(3)]
    return [{}] * 6


def _submit(pipe: Pipeline, cell: dict, prompts: list[torch.Tensor], limits: list[int]) -> list:
    decodings = _decodings(cell["decoding"])
    futures = [pipe.submit(prompt, limit, **decoding)
               for prompt, limit, decoding in zip(prompts[:3], limits[:3], decodings[:3], strict=True)]
    if cell["decoding"] == "n":
        futures += pipe.submit_all(prompts[3:], limits[3:], do_sample=True, top_k=20,
                                   seed=[decoding["seed"] for decoding in decodings[3:]])
    else:
        futures += [pipe.submit(prompt, limit, **decoding)
                    for prompt, limit, decoding in zip(prompts[3:], limits[3:], decodings[3:], strict=True)]
    return futures


def _check(model, cell: dict, prompts: list[torch.Tensor], limits: list[int], results: list) -> None:
    """Every result equals its reference: static, `model.generate` on its microbatch with each row's own draws
    and ends; continuous, the replay of its schedule."""
    decodings = _decodings(cell["decoding"])
    rules = TokenRules.of(model)
    if cell["batching"] == "continuous":
        requests = {result.request: Request(prompt, limit, Decoding.of(**decoding))
                    for result, prompt, limit, decoding in zip(results, prompts, limits, decodings, strict=True)}
        for index, result in enumerate(results):
            want = replay(model, result.schedule, requests)[result.request]
            assert result.tokens.tolist() == want.tolist(), f"request {index}"
    else:
        for members in expectations.microbatches(results):
            rows = expectations.replayed(model, prompts, members, [decodings[index] for index in members],
                                         [max(limits)] * len(members), rules.pad, rules.eos)
            for index, row in zip(members, rows, strict=True):
                ends = Decoding.of(**decodings[index]).ends.ids(rules.eos)
                tokens = row.tolist()[:limits[index]]
                end = next((position for position, token in enumerate(tokens) if token in ends), None)
                want = tokens if end is None else tokens[:end + 1]
                assert results[index].tokens.tolist() == want, f"request {index}"
    for index, (result, decoding) in enumerate(zip(results, decodings, strict=True)):
        if decoding.get("logprobs") is not None:
            assert result.logprobs is not None, f"request {index} asked for log-probabilities"
            assert len(result.logprobs) == result.tokens.numel()


def _victims(pipe: Pipeline, layout: str) -> list[str]:
    """The stages killed one after another: a token stage, then the last stage (one stage: the only one)."""
    names = [stage["name"] for stage in pipe.status()["stages"]]
    return names[-1:] if layout == "one stage" else names[-2:]


def _wait_for_steps(pipe: Pipeline, count: int, timeout: float) -> None:
    """Until the microbatches in flight have run `count` steps (rounds) between them."""
    deadline = time.monotonic() + timeout
    while sum(batch["steps"] for batch in pipe.status()["microbatches"]) < count:
        assert time.monotonic() < deadline, f"{count} steps within {timeout} s"
        time.sleep(0.002)


def _options(cell: dict, tmp_path) -> dict:
    recovery = cell["recovery"]
    options = {**LAYOUTS[cell["layout"]], "batching": cell["batching"], "swapping": cell["swapping"],
               "microbatch": 3, "timeout": 60, "threads": 1, "max_prefill_tokens": 6}
    if recovery is not None:
        # its victims are killed, and found by their exit: heartbeats need only not raise a false alarm on a loaded
        # machine (a hung stage's detection has tests of its own)
        options.update(recovery="replicas" if recovery == "replicas+store" else recovery, heartbeat=0.5,
                       missed_beats=6)
    if recovery == "replicas+store":
        options["replica_store"] = f"file://{tmp_path}/replicas"
    return options


def run_cell(cell: dict, tmp_path) -> str:
    """Serve the cell and check it; what happened, for the table ("exact", "exact after kills", or the refusal)."""
    prompts = [prompt.clamp(max=90) for prompt in expectations.prompts(6, seed=57)]
    prompts[4] = prompts[5] = prompts[3]  # "n": three choices of one prompt (the others too: harmless)
    model = getattr(tiny_models, cell["family"])()
    try:
        pipe = Pipeline(f"tiny_models:{cell['family']}", **_options(cell, tmp_path))
    except dv.ConfigError as error:
        refusal = str(error)
    else:
        refusal = None
    if refusal is not None:
        reason = next((fragment for fragment in REFUSALS if fragment in refusal), None)
        assert reason is not None, f"refused for a reason not listed in REFUSALS: {refusal}"
        return f"refused: {REFUSALS[reason]}"
    with pipe:
        assert pipe.batching == cell["batching"]
        results = [future.result(timeout=120) for future in _submit(pipe, cell, prompts, LIMITS)]
        _check(model, cell, prompts, LIMITS, results)
        if cell["recovery"] is None:
            return "exact"
        victims = _victims(pipe, cell["layout"])
        for killed, victim in enumerate(victims, start=1):
            futures = _submit(pipe, cell, prompts, LONGER)
            _wait_for_steps(pipe, 3, 60)
            os.kill(next(stage["pid"] for stage in pipe.status()["stages"] if stage["name"] == victim),
                    signal.SIGKILL)
            again = [future.result(timeout=120) for future in futures]
            assert [name for report in pipe.recoveries for name in report.replaced] == victims[:killed]
            _check(model, cell, prompts, LONGER, again)
    return f"exact after {' then '.join(victims)} {'was' if len(victims) == 1 else 'were'} killed"


#: Cells the slow tier runs beside the pairwise set: each once failed where the pairwise set did not look.
REGRESSIONS = [
    # a static slot's capacity after a recovery: its longest prompt and largest limit (rows keep their padding)
    {"batching": "static", "recovery": "replicas+store", "layout": "disaggregated", "swapping": True,
     "decoding": "n", "family": "llama"},
]


def _cells(full: bool) -> Iterator:
    cells = ([dict(zip(FACTORS, values, strict=True)) for values in itertools.product(*FACTORS.values())]
             if full else pairwise(FACTORS) + [cell for cell in REGRESSIONS if cell not in pairwise(FACTORS)])
    for cell in cells:
        yield pytest.param(cell, id=_cell_id(cell))


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(_cells(full=False)))
def test_every_pair_of_options_serves_exactly(cell, tmp_path) -> None:
    print(_cell_id(cell), run_cell(cell, tmp_path))


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("cell", list(_cells(full=True)))
def test_every_combination_of_options_serves_exactly(cell, tmp_path) -> None:
    print(_cell_id(cell), run_cell(cell, tmp_path))


def test_the_pairwise_set_covers_every_pair_of_option_values() -> None:
    cells = pairwise(FACTORS)
    for a, b in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            assert any(cell[a] == x and cell[b] == y for cell in cells), (a, x, b, y)
    assert len(cells) < 40  # far fewer than the product's


if __name__ == "__main__":  # the table of docs/serving.md: `python tests/test_matrix.py [--full]`
    import sys
    import tempfile
    from pathlib import Path

    tests = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    print("| " + " | ".join(FACTORS) + " | outcome |")
    print("|" + "---|" * (len(FACTORS) + 1))
    for parameter in _cells(full="--full" in sys.argv):
        (cell,) = parameter.values
        with tempfile.TemporaryDirectory() as scratch:
            outcome = run_cell(cell, Path(scratch))
        print("| " + " | ".join(str(value) for value in cell.values()) + f" | {outcome} |", flush=True)

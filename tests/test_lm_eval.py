"""lm-evaluation-harness against the front door, unchanged: `local-completions` on a log-likelihood task (echo and
logprobs) and a generate-until task (stop strings), `local-chat-completions` on the generate-until task through the
chat template; every score and every sample's answer equal lm-eval's `hf` backend on the same model (SmolLM2,
greedy). lm-eval finds the server's tokenizer on its own (`/tokenizer_info`), or takes a local copy. The tasks are
local files in tests/lm_eval_tasks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import dejavu_sdk as dv
from dejavu_sdk.models import default_cache_dir

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "lm_eval_tasks"
CHOICE, ANSWER = "dejavu_choice", "dejavu_answer"


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = dv.load_smollm2()  # saves the Hugging Face directory lm-eval's tokenizer is read from
    return model, tokenizer


@pytest.fixture
def offline(monkeypatch):
    """The tasks' data files are read from their folder, nothing from a hub."""
    monkeypatch.chdir(TASKS)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def _evaluate(model, tasks: list[str], **options) -> dict:
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)  # lm-eval's own tasks are not indexed
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager,
                                   log_samples=True, batch_size=1, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0, **options)


def _answers(results: dict, task: str) -> list:
    """Each sample's filtered answer, in document order."""
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_through_the_front_door_equals_its_hf_backend(smollm2, offline, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, "dejavu_sdk.access")
    model, tokenizer = smollm2
    local = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    reference = _evaluate(local, [CHOICE, ANSWER])
    reference_chat = _evaluate(local, [ANSWER], apply_chat_template=True)
    directory = default_cache_dir()
    with dv.Controller("smollm2", stages=1, microbatch=4, port=0, timeout=120,
                       served_model_name="smollm2") as controller:
        monkeypatch.setenv("OPENAI_API_KEY", controller.token)
        common = "model=smollm2,num_concurrent=1,max_retries=1"
        # the tokenizer found on its own: the server's (/tokenizer_info, /tokenize, /detokenize with the token)
        served = _evaluate("local-completions", [CHOICE, ANSWER],
                           model_args=f"base_url={controller.url}/v1/completions,{common},tokenized_requests=True,"
                                      f"auth_token={controller.token}")
        # or a local copy of the model's tokenizer
        served_chat = _evaluate("local-chat-completions", [ANSWER], apply_chat_template=True,
                                model_args=f"base_url={controller.url}/v1/chat/completions,{common},"
                                           f"tokenizer_backend=huggingface,tokenizer={directory}")
    # log-likelihoods: each choice's sum and whether it is the greedy continuation, as the hf backend has them
    for mine, theirs in zip(_answers(served, CHOICE), _answers(reference, CHOICE), strict=True):
        assert [flag for _, flag in mine] == [flag for _, flag in theirs]
        assert [float(value) for value, _ in mine] == pytest.approx([float(value) for value, _ in theirs], abs=2e-3)
    assert _answers(served, ANSWER) == _answers(reference, ANSWER)
    assert any("/tokenizer_info" in record.getMessage() for record in caplog.records)  # lm-eval found it
    assert _answers(served_chat, ANSWER) == _answers(reference_chat, ANSWER)
    assert any(answer != [""] for answer in _answers(served, ANSWER))  # the answers say something
    for task in (CHOICE, ANSWER):
        assert served["results"][task] == reference["results"][task]
    assert served_chat["results"][ANSWER] == reference_chat["results"][ANSWER]

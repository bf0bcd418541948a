"""lm-evaluation-harness against a real ``actorline serve --http-port`` (the shared server of
:mod:`tests.pipeline.server.http.conftest`, the tiny model), as its users run it: model
``local-completions`` on a multiple-choice task and a ``generate_until`` task built here from
local data (a task YAML over a jsonl file; no dataset hub, no network). The multiple-choice
loglikelihoods (``echo`` with ``logprobs``, the prompt's scores) equal HF's for the same
model and tokens; the generations equal the server's own answer to the same request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.pipeline.engine.test_prompt_logprobs import hf_logprobs
from tests.pipeline.server.http.conftest import API_KEY, MODEL
from tests.pipeline.server.serving import ServeProcess

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

MULTIPLE_CHOICE = [
    {"question": "The sky on a clear day is", "choices": [" blue", " green", " loud"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven", " a fish", " ten"],
     "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin"],
     "answer": 0},
]  # fmt: skip
GENERATION = [
    {"question": "Question: name a colour.\nAnswer:", "answer": " red"},
    {"question": "Question: count to three.\nAnswer:", "answer": " 1 2 3"},
]
MAX_GEN_TOKS = 8

TASKS = """\
task: actorline_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
---
task: actorline_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""

#: runs lm-eval in a fresh interpreter (its dataset library reads the offline switches when
#: imported) and prints each task's samples and metrics as JSON
RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
base_url, tokenizer, include = sys.argv[1:4]
results = lm_eval.simple_evaluate(
    model="local-completions",
    model_args={"model": "tiny", "base_url": base_url, "tokenizer_backend": "huggingface",
                "tokenizer": tokenizer, "tokenized_requests": True, "max_length": 1024,
                "max_retries": 1},
    tasks=["actorline_mc", "actorline_gen"],
    task_manager=TaskManager(include_path=include, include_defaults=False),
    log_samples=True,
)
keep = {"results": results["results"], "samples": results["samples"]}
print("RESULT " + json.dumps(keep, default=str))
"""


def write_tasks(directory: Path) -> Path:
    tasks = directory / "tasks"
    tasks.mkdir()
    mc, gen = directory / "mc.jsonl", directory / "gen.jsonl"
    mc.write_text("".join(json.dumps(doc) + "\n" for doc in MULTIPLE_CHOICE))
    gen.write_text("".join(json.dumps(doc) + "\n" for doc in GENERATION))
    documents = TASKS.format(mc=mc, gen=gen, max_gen_toks=MAX_GEN_TOKS).split("---\n")
    for name, document in zip(("mc", "gen"), documents):
        (tasks / f"actorline_{name}.yaml").write_text(textwrap.dedent(document))
    return tasks


def run_lm_eval(serve: ServeProcess, model_dir: Path, tasks: Path, home: Path) -> Any:
    env = {
        **os.environ,
        "OPENAI_API_KEY": API_KEY,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
    }
    base_url = f"{serve.http_url}/completions"
    result = subprocess.run(
        [sys.executable, "-c", RUN, base_url, str(model_dir), str(tasks)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def hf_loglikelihood(model_dir: Path, tokenizer: Any, context: str, continuation: str) -> float:
    """HF's loglikelihood of ``continuation`` after ``context``, on the tokens lm-eval sends
    (its ``_encode_pair``: the whole encoded, the context's tokens split off)."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    table = hf_logprobs(model_dir, whole)  # row i scores token i + 1
    return sum(table[i - 1][whole[i]].item() for i in range(len(context_ids), len(whole)))


def test_lm_eval_local_completions(
    openai_serve: ServeProcess, client: openai.OpenAI, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tasks = write_tasks(tmp_path)
    report = run_lm_eval(openai_serve, tiny_model_dir, tasks, tmp_path / "hf-home")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    samples = report["samples"]["actorline_mc"]
    assert len(samples) == len(MULTIPLE_CHOICE)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        ours = [float(resp[0][0]) for resp in sample["resps"]]
        expected = [
            hf_loglikelihood(tiny_model_dir, tokenizer, context, continuation)
            for context, continuation in sample["arguments"]
        ]
        assert len(ours) == len(doc["choices"])
        assert ours == pytest.approx(expected, abs=1e-3)
        correct += int(torch.tensor(expected).argmax()) == doc["answer"]
    accuracy = report["results"]["actorline_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(MULTIPLE_CHOICE))

    generated = report["samples"]["actorline_gen"]
    assert len(generated) == len(GENERATION)
    for sample in generated:
        ids = tokenizer(sample["doc"]["question"], add_special_tokens=False).input_ids
        direct = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=MAX_GEN_TOKS, temperature=0,
            stop=["\n", tokenizer.eos_token],  # lm-eval adds the end-of-text string
        )  # fmt: skip
        assert sample["resps"][0][0] == direct.choices[0].text
    assert "exact_match,none" in report["results"]["actorline_gen"]

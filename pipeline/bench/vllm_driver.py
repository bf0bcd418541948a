"""The offline benchmark's vLLM side: a script that runs under the interpreter of the virtual
environment :mod:`pipeline.bench.vllm_peer` creates for vLLM, never imported by actorline
(it imports only the standard library and vLLM).

    <vllm venv>/bin/python vllm_driver.py SPEC.json

``SPEC.json`` holds ``model`` (a directory), ``dtype``, ``prompts`` (token ids),
``max_tokens`` (one per prompt), ``max_num_seqs``, ``max_num_batched_tokens``,
``max_model_len`` and ``warmup_tokens``. The script builds ``vllm.LLM`` (vLLM's own defaults
otherwise: torch.compile, chunked prefill, prefix caching), runs one short warm-up request
(prompt 0), then times one ``LLM.generate`` over every prompt as token ids, greedy and EOS
ignored, as vLLM's ``benchmarks/benchmark_throughput.py`` does. The last line it prints on
stdout is ``ACTORLINE_PEER_RESULT {json}`` with ``vllm_version``, ``load_seconds``,
``seconds`` and ``outputs`` (each request's generated token ids, in order); vLLM's own logs go
to stderr and stdout before it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RESULT_MARKER = "ACTORLINE_PEER_RESULT "


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Load vLLM as ``spec`` says, warm it up and time the workload; the result record."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    began = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    load_seconds = time.perf_counter() - began
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in spec["prompts"]]
    warmup = SamplingParams(max_tokens=spec["warmup_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], warmup, use_tqdm=False)
    params = [
        SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
        for limit in spec["max_tokens"]
    ]
    began = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    return {
        "vllm_version": vllm.__version__,
        "load_seconds": load_seconds,
        "seconds": seconds,
        "outputs": [list(output.outputs[0].token_ids) for output in outputs],
    }


def main(argv: list[str]) -> int:
    """Run the spec file named by ``argv[1]`` and print the result line; the exit status."""
    if len(argv) != 2:
        print(f"usage: {argv[0]} SPEC.json", file=sys.stderr)
        return 2
    with open(argv[1]) as file:
        spec = json.load(file)
    print(RESULT_MARKER + json.dumps(run(spec)), flush=True)
    return 0


if __name__ == "__main__":  # vLLM's engine starts processes that import this file again
    sys.exit(main(sys.argv))

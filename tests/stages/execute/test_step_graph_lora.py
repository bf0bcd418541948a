"""LoRA in the CPU step graph (stages/execute/step_graph_lora.py): decode steps with adapter
rows run as the one native call, their logits within the step graph's tolerance of the module
path's, greedy-identical to HF with each adapter merged; the one-region and per-op forms agree
bit for bit; what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.execute.attention import build_step_metadata, forward_context
from stages.execute.lora import lora_rows
from stages.execute.runner import ModelRunner
from stages.execute.step_graph import CHECK_TOLERANCE, MAX_ROWS, StepLoRA
from stages.execute.step_graph_lora import StepGraphLoRA, step_lora
from stages.lora import LoRARequest
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
from stages.params import SamplingParams
from tests.stages.execute.driving import HFReference, drive
from tests.stages.execute.test_lora import (
    GREEDY,
    MAX_TOKENS,
    load_runner,
    lora_of,
    merged_references,
    prompts_of,
    three_adapters,
)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """test_lora's adapters (a1: every projection; a2: q/v/o, rsLoRA; a3: gate without up)."""
    return three_adapters(tiny_model_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, HFReference]:
    return merged_references(tiny_model_dir, adapters)


NAMES = ("base", "a1", "a2", "a3")


def graph_steps(runner: ModelRunner) -> int:
    assert runner.step_graph is not None
    return runner.step_graph.steps


def test_mixed_decode_rows_run_on_the_graph_and_match_merged_hf(
    tiny_model_dir: Path, adapters: dict[str, Path], references: dict[str, HFReference]
) -> None:
    """Base rows and rows of three adapters (one of them attention only, one gate without
    up) in the same decode steps: every decode step runs on the step graph, and each request
    is greedy-identical to HF with its adapter merged."""
    runner = load_runner(tiny_model_dir, num_blocks=128)
    prompts = prompts_of((5, 19), seed=17)
    requests = [
        EngineRequest(
            f"{name}-{i}",
            tuple(p),
            GREEDY,
            lora=None if name == "base" else lora_of(adapters, name),
        )
        for i, p in enumerate(prompts)
        for name in NAMES
    ]
    before = graph_steps(runner)
    report = drive(runner, requests)
    decode_steps = sum(
        1 for step in report.steps if step.chunks and all(c.num_tokens == 1 for c in step.chunks)
    )
    assert decode_steps >= MAX_TOKENS - 1
    assert graph_steps(runner) - before == decode_steps
    for index, prompt in enumerate(prompts):
        for name in NAMES:
            expected = references[name].greedy(prompt, MAX_TOKENS)
            assert report.outputs[f"{name}-{index}"] == expected, (name, index)
    for name in NAMES[1:]:  # the adapters change the tokens
        assert any(report.outputs[f"{name}-{i}"] != report.outputs[f"base-{i}"] for i in range(2))


def one_step_three_ways(
    runner: ModelRunner, loras: list[LoRARequest | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of ``len(loras)`` prefilled rows (row ``r`` under adapter ``loras[r]``,
    None: the base model; contexts across block boundaries), its logits through the model's
    modules, through the step graph in one OpenMP region and through it per op."""
    graph, bank, cache = runner.step_graph, runner.lora, runner.kv_cache
    assert graph is not None and bank is not None and cache is not None
    assert runner.allocator is not None
    prompts = prompts_of(tuple(6 + 5 * r for r in range(len(loras))), seed=len(loras))
    names = [f"d{len(loras)}-{r}" for r in range(len(loras))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    requests = tuple(
        EngineRequest(n, tuple(p), params, lora=lora)
        for n, p, lora in zip(names, prompts, loras, strict=True)
    )
    chunks = tuple(ScheduledChunk(n, 0, len(p) - 1) for n, p in zip(names, prompts, strict=True))
    runner.execute(SchedulerStep(0, requests, chunks))
    for name, prompt in zip(names, prompts, strict=True):
        runner.allocator.allocate(name, len(prompt))  # the decode row's slot
    try:
        tables = [runner.allocator.block_table(name) for name in names]
        positions = [len(p) - 1 for p in prompts]
        tokens = [p[-1] for p in prompts]
        adapters = [None if lora is None else bank.acquire(lora, set()) for lora in loras]
        metadata, position_ids = build_step_metadata(
            kv_cache=cache, block_tables=tables, query_starts=positions,
            query_lens=[1] * len(names), num_decode=len(names), decode_mode="grouped",
            max_model_len=runner.max_model_len, device=torch.device("cpu"),
        )  # fmt: skip
        spans = [(adapter, row, row + 1) for row, adapter in enumerate(adapters)]
        with torch.inference_mode(), forward_context(metadata), lora_rows(bank, spans):
            module = runner.model(
                input_ids=torch.tensor([tokens]),
                position_ids=position_ids.unsqueeze(0),
                use_cache=False,
            ).logits[0]
        tables_of = StepGraphLoRA(bank, graph)
        lora = step_lora(tables_of, [(adapter, 1) for adapter in adapters])
        step = (tokens, positions, tables, range(len(names)), lora)
        graph.threaded = True
        threaded = graph.run(*step)
        graph.threaded = False
        per_op = graph.run(*step)
        return module, threaded, per_op
    finally:
        graph.threaded = True
        runner.execute(SchedulerStep(1, finished=tuple(names)))


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within the step graph's tolerance of the module path (relative to the largest logit),
    the bound its load-time probe applies (stages.execute.step_graph.CHECK_TOLERANCE)."""
    scale = max(expected.abs().max().item(), 1.0)
    return (got - expected).abs().max().item() <= CHECK_TOLERANCE * scale


@pytest.mark.parametrize("fields", [{}, {"quantization": "int8"}], ids=["fp32", "int8"])
def test_a_step_of_base_rows_and_two_adapters_gives_the_module_paths_logits(
    tiny_model_dir: Path, adapters: dict[str, Path], fields: dict[str, object]
) -> None:
    """Base rows between rows of two adapters (a1 everywhere, a2 on q/v/o only), at 1, 2 and
    3 threads: the step graph's logits are within its tolerance of the module path's (the
    delta's sums run in another order than torch's GEMMs), its two forms equal bit for bit
    (every element summed by the same code in the same order), and the adapters' rows differ
    from what the base model gives them."""
    runner = load_runner(tiny_model_dir, num_blocks=128, block_size=4, **fields)
    assert runner.step_graph is not None and runner.step_graph.threaded
    a1, a2 = lora_of(adapters, "a1"), lora_of(adapters, "a2")
    loras: list[LoRARequest | None] = [None, a1, a2, None, a1, a2, a2]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            module, threaded, per_op = one_step_three_ways(runner, loras)
            assert torch.equal(threaded, per_op), count
            assert close(threaded, module), (count, (threaded - module).abs().max().item())
        _, base, _ = one_step_three_ways(runner, [None] * len(loras))
    finally:
        torch.set_num_threads(threads)
    for row, lora in enumerate(loras):
        changed = not torch.equal(threaded[row], base[row])
        assert changed == (lora is not None), row


def test_tables_are_kept_per_set_of_adapters(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """A set of adapters' table is built once and serves later steps of the same set (in
    any row order); a step of base rows only takes no table."""
    runner = load_runner(tiny_model_dir, num_blocks=64)
    graph, bank = runner.step_graph, runner.lora
    assert graph is not None and bank is not None
    tables = StepGraphLoRA(bank, graph)
    one, two = (bank.acquire(lora_of(adapters, name), set()) for name in ("a1", "a2"))
    assert step_lora(tables, [(None, 3)]) is None
    first = step_lora(tables, [(one, 2), (None, 1), (two, 1)])
    assert first is not None and first.groups == (0, 0, -1, 1)
    again = step_lora(tables, [(one, 1), (two, 2)])
    assert again is not None and again.table == first.table and tables.tables_built == 1
    swapped = step_lora(tables, [(two, 1), (one, 1)])  # another order: another concatenation
    assert swapped is not None and swapped.groups == (0, 1) and tables.tables_built == 2


def test_refusals(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    """A group per row missing, a group out of range, and adapter rows on no tables are
    refused with ValueError before anything runs."""
    runner = load_runner(tiny_model_dir, num_blocks=64)
    graph, bank = runner.step_graph, runner.lora
    assert graph is not None and bank is not None and runner.allocator is not None
    one = bank.acquire(lora_of(adapters, "a1"), set())
    with pytest.raises(ValueError, match="serves no LoRA"):
        step_lora(None, [(one, 1)])
    lora = step_lora(StepGraphLoRA(bank, graph), [(one, 1)])
    assert lora is not None
    runner.allocator.allocate("r", 3)
    table = runner.allocator.block_table("r")
    with pytest.raises(ValueError, match="LoRA groups for 1 rows"):
        graph.run([5], [2], [table], [0], StepLoRA(lora.table, lora.rank, (0, 0), lora.keep))
    with pytest.raises(ValueError, match="out of range"):
        graph.run([5], [2], [table], [0], StepLoRA(lora.table, lora.rank, (MAX_ROWS,), lora.keep))

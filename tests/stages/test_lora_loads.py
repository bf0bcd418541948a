"""LoRA adapters load beside the steps (docs/lora.md, "Loading"): while an adapter loads on
the execute stage's loader thread, a running stream keeps producing tokens and the adapter's
request waits (neither failed nor run on the base model), then runs as HF with the adapter
merged; an adapter that turns unservable while it waits fails its own request alone, nothing
of it loaded; a request aborted while its adapter loads never runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from pipeline import AsyncEngine, LoRARequest, SamplingParams
from stages.errors import InvalidRequestError
from stages.messages import RequestOutput
from tests.stages.execute.driving import HFReference
from tests.stages.execute.lora_adapters import make_adapter

PROMPT = [101, 2045, 3077, 517, 9000, 12, 77, 4242, 31, 5]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
#: tokens the base stream must produce while the adapter's load is held up
WHILE_LOADING = 16


async def collect(engine: AsyncEngine, lora: LoRARequest, request_id: str) -> RequestOutput:
    last = None
    async for output in engine.generate(
        {"prompt_token_ids": PROMPT}, GREEDY, request_id=request_id, lora_request=lora
    ):
        last = output
    assert last is not None
    return last


@pytest.mark.slow
def test_a_stream_runs_on_while_an_adapter_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    good = make_adapter(tiny_model_dir, tmp_path / "good", seed=31)
    spoiled = make_adapter(tiny_model_dir, tmp_path / "spoiled", seed=32, merged=False)
    aborted = make_adapter(tiny_model_dir, tmp_path / "aborted", seed=33, merged=False)
    loras = {
        name: LoRARequest(name, number, str(path))
        for number, (name, path) in enumerate(
            (("good", good), ("spoiled", spoiled), ("aborted", aborted)), start=1
        )
    }
    expected = HFReference(Path(f"{good}-merged")).greedy(PROMPT, GREEDY.max_tokens or 0)

    async def run() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), transport="memory", enable_lora=True, max_loras=3,
            num_blocks=64,
        ) as engine:  # fmt: skip
            execute = engine.running.stage("execute")
            bank = execute.runner.lora  # type: ignore[attr-defined]
            gate = threading.Event()
            # the loader thread is busy (as with another adapter's load) until the gate opens
            blocker = execute.lora_loader().submit(gate.wait, 120)  # type: ignore[attr-defined]
            stream = engine.generate(
                "a long base stream", SamplingParams(max_tokens=400, ignore_eos=True)
            )
            base_tokens = len((await anext(stream)).token_ids)
            waiting = {
                name: asyncio.create_task(collect(engine, lora, name))
                for name, lora in loras.items()
            }
            # the checks at the frontend passed; now the spoiled adapter's weights go bad
            await asyncio.sleep(0.2)
            (spoiled / "adapter_model.safetensors").write_bytes(b"\0" * 16)
            progress = []
            async for output in stream:
                progress.append(len(output.token_ids))
                if len(output.token_ids) >= base_tokens + WHILE_LOADING:
                    break
            # the base stream ran on; the adapters' requests wait, none ran, none failed
            assert progress[-1] >= base_tokens + WHILE_LOADING
            assert not any(task.done() for task in waiting.values())
            assert bank.loaded() == [] and not blocker.done()
            waiting["aborted"].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting["aborted"]
            gate.set()
            output = await waiting["good"]
            assert list(output.token_ids) == expected
            with pytest.raises(InvalidRequestError, match=r"LoRA adapter 'spoiled'.*not readable"):
                await waiting["spoiled"]
            async for _ in stream:
                pass
            loaded = {lora.lora_name for lora in bank.loaded()}
            assert "good" in loaded and "spoiled" not in loaded
            # every load ran on the loader thread: the step thread only swapped them in
            assert bank.step_thread_loads == 0

    asyncio.run(run())


def test_an_adapter_admitted_for_a_waiting_request_stays_loaded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With one adapter kept (max_loras 1), two adapters prepared off the step thread for
    their requests both stay until those requests run: the second is not unloaded when the
    first one's request registers, so the step thread reads neither."""
    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner

    runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), enable_lora=True, num_blocks=16))
    runner.load()
    bank = runner.lora
    assert bank is not None and bank.max_cpu_loras == 1
    b1, b2, b3 = (
        LoRARequest(f"b{i}", i, str(write_adapter(tmp_path / f"b{i}", bank))) for i in (1, 2, 3)
    )
    bank.offer(bank.prepare(b1))
    bank.offer(bank.prepare(b2))
    bank.acquire(b1, set())  # b1's request runs; b2's still waits
    assert bank.ready(b2)
    bank.acquire(b2, {1})
    assert {lora.lora_name for lora in bank.loaded()} == {"b1", "b2"}
    assert bank.step_thread_loads == 0 and bank.loads == 2
    # an adapter not prepared ahead (execute on another host) is read on the step thread
    bank.acquire(b3, set())
    assert bank.step_thread_loads == 1


def write_adapter(path: Path, bank: Any) -> Path:
    """A rank-2 PEFT adapter on the q and down projections of every layer of ``bank``'s
    model, random weights written as peft names them."""
    import torch
    from safetensors.torch import save_file

    shapes = {name: (inputs, outputs) for name, inputs, outputs in bank.target_shapes()}
    tensors = {}
    for layer in range(bank.num_layers):
        for name, part in (("q_proj", "self_attn"), ("down_proj", "mlp")):
            inputs, outputs = shapes[name]
            stem = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(2, inputs)
            tensors[f"{stem}.lora_B.weight"] = torch.randn(outputs, 2)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": sorted(shapes)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path

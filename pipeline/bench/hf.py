"""The HF transformers baselines of the offline benchmark, on given token ids, greedy, never
stopping at EOS (every request generates exactly its ``max_tokens``):

- :func:`hf_static_generate`: ``model.generate`` on static batches (left padding; each batch
  runs to its longest request's ``max_tokens``; only each request's own tokens count);
- :func:`hf_continuous_generate`: transformers' continuous batching
  (``transformers/generation/continuous_batching/``: a ``ContinuousBatchingManager`` fed one
  request at a time with its own ``max_new_tokens``), with its paged KV cache on the CPU;
- :func:`hf_greedy_reference`: one request alone (no padding), the reference for greedy
  equality checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pipeline.bench.workload import blocks_to_hold

__all__ = [
    "CB_ATTENTION",
    "CB_PAGE_SIZE",
    "HfRun",
    "hf_continuous_generate",
    "hf_greedy_reference",
    "hf_static_generate",
    "load_hf_model",
]

#: attention implementations transformers' continuous batching accepts on the CPU
CB_ATTENTION = ("sdpa", "paged|eager")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: KV page size (tokens) given to transformers' continuous batching
CB_PAGE_SIZE = 64
#: a request id for transformers' continuous batching warm-up request
_WARMUP_ID = "__warmup__"
_WARMUP_TOKENS = 4
_RESULT_POLL_SECONDS = 1.0
_STOP_TIMEOUT_SECONDS = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class HfRun:
    """One baseline run: ``outputs[i]`` are request i's generated tokens (exactly its own
    ``max_tokens``); ``generated_tokens`` their total; ``seconds`` the timed generation."""

    seconds: float
    generated_tokens: int
    outputs: tuple[tuple[int, ...], ...]


def load_hf_model(model_dir: Any, dtype: str = "float32", attention: str = "sdpa") -> Any:
    """The HF causal LM in ``model_dir``, in eval mode, set never to stop at EOS (its
    generation config's EOS is cleared, so ``generate`` runs to ``max_new_tokens``).

    Raises:
        ValueError: an unknown dtype.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=_DTYPES[dtype], attn_implementation=attention
    )
    model.eval()
    # NOTE: a GenerationConfig passed to generate() with eos_token_id=None is completed from
    # the model's own generation config, which would stop at EOS: clear it at the source.
    model.generation_config.eos_token_id = None
    return model


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)


def _greedy_config(max_new_tokens: int, pad_token_id: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )


def hf_greedy_reference(
    model: Any, prompt: Sequence[int], max_tokens: int, pad_token_id: int
) -> tuple[int, ...]:
    """Greedy ``generate`` of one request alone: its ``max_tokens`` generated token ids."""
    input_ids = torch.tensor([list(prompt)], dtype=torch.long)  # [1, P]
    with torch.inference_mode(), _quiet_transformers():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=_greedy_config(max_tokens, pad_token_id),
        )  # [1, P + max_tokens]
    return tuple(out[0, len(prompt) : len(prompt) + max_tokens].tolist())


def hf_static_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    batch_size: int,
    pad_token_id: int,
) -> HfRun:
    """``generate`` on consecutive batches of ``batch_size`` requests, left-padded, greedy,
    each batch to its longest request's ``max_tokens`` (one warm-up batch first, untimed).

    Raises:
        ValueError: ``prompts`` and ``max_tokens`` differ in length, or batch_size < 1.
    """
    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _static_batch(model, [list(prompts[0])], [_WARMUP_TOKENS], pad_token_id)  # warm-up
    outputs: list[tuple[int, ...]] = []
    began = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[first : first + batch_size]]
        outputs.extend(
            _static_batch(model, batch, max_tokens[first : first + batch_size], pad_token_id)
        )
    seconds = time.perf_counter() - began
    return HfRun(seconds, sum(len(output) for output in outputs), tuple(outputs))


def _static_batch(
    model: Any, prompts: list[list[int]], max_tokens: Sequence[int], pad_token_id: int
) -> list[tuple[int, ...]]:
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # [B, W]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, W]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode(), _quiet_transformers():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            generation_config=_greedy_config(max(max_tokens), pad_token_id),
        )  # [B, W + max(max_tokens)]
    return [tuple(out[row, width : width + own].tolist()) for row, own in enumerate(max_tokens)]


def hf_continuous_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    max_batch_tokens: int,
    max_requests_per_batch: int,
    pad_token_id: int,
) -> HfRun:
    """transformers' continuous batching: start a manager sized to hold every request's KV
    cache at once, run one short warm-up request (untimed), then time adding every request
    (each with its own ``max_new_tokens``, EOS disabled) until all have finished.

    Raises:
        ValueError: ``prompts`` and ``max_tokens`` differ in length.
        RuntimeError: the manager stopped before every request finished, or one failed.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    pages = blocks_to_hold(prompts, max_tokens, CB_PAGE_SIZE)
    cb_config = ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=pages + 2,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        use_cuda_graph=False,
        use_async_batching=False,
    )
    # eos_token_id=-1: transformers' own "disabled" value (it sets it, with a warning, when
    # the config has none).
    generation_config = GenerationConfig(
        max_new_tokens=max(max_tokens),
        do_sample=False,
        pad_token_id=pad_token_id,
        eos_token_id=-1,
    )
    results: dict[str, tuple[int, ...]] = {}
    with (
        torch.inference_mode(),
        _quiet_transformers(),
        model.continuous_batching_context_manager(
            generation_config=generation_config,
            continuous_batching_config=cb_config,
            block=True,
            timeout=_STOP_TIMEOUT_SECONDS,
            warmup=False,
        ) as manager,
    ):
        manager.add_request(
            list(prompts[0]), request_id=_WARMUP_ID, max_new_tokens=_WARMUP_TOKENS, eos_token_id=-1
        )
        _collect(manager, {_WARMUP_ID}, {})
        ids = [f"r{index}" for index in range(len(prompts))]
        began = time.perf_counter()
        for request_id, prompt, own in zip(ids, prompts, max_tokens):
            # NOTE: eos_token_id=-1 disables EOS for the request (RequestState keeps only
            # non-negative ids), matching ignore_eos.
            manager.add_request(
                list(prompt), request_id=request_id, max_new_tokens=own, eos_token_id=-1
            )
        _collect(manager, set(ids), results)
        seconds = time.perf_counter() - began
    outputs = tuple(results[request_id] for request_id in ids)
    return HfRun(seconds, sum(len(output) for output in outputs), outputs)


def _collect(manager: Any, wanted: set[str], results: dict[str, tuple[int, ...]]) -> None:
    """Wait until every request in ``wanted`` finished; their tokens go into ``results``."""
    waiting = set(wanted)
    while waiting:
        result = manager.get_result(timeout=_RESULT_POLL_SECONDS)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(
                    f"transformers' continuous batching stopped with {len(waiting)} requests "
                    "unfinished"
                )
            continue
        if result.request_id not in waiting or not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"transformers' continuous batching failed: {result.error}")
        waiting.discard(result.request_id)
        results[result.request_id] = tuple(result.generated_tokens)

"""Which decoder layers each pipeline-parallel shard holds (``docs/architecture.md`` §8,
docs/parallelism.md "Pipeline parallelism").

Pure: no torch. The split is checked from the model's config alone, before anything loads
(the engine's preflight and each shard's runner both call :func:`layer_ranges`), so a split
that cannot work is refused with the numbers. The even split gives the first shards one more
layer where the count does not divide, as vLLM's ``get_pp_indices``
(``vllm/distributed/utils.py``) does with its remainder, except that actorline refuses an
indivisible count unless an explicit split is given (the issue asks that uneven splits be
chosen, not fallen into).
"""

from __future__ import annotations

from typing import Any

from stages.execute.config import ExecuteConfigError, parse_split

__all__ = [
    "PIPELINE_MODEL_TYPES",
    "PipelineParallelError",
    "check_pipeline_parallel",
    "layer_ranges",
]

#: model types whose decoder takes ``inputs_embeds`` as the hidden state as it is (no scaling
#: of it inside the forward, as Gemma's ``normalizer`` does), keeps its residual inside each
#: layer, and ends in ``norm``: a shard can start from another shard's hidden state
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class PipelineParallelError(RuntimeError):
    """A pipeline-parallel step did not come back: a shard died (the runtime sees its
    process exit first) or did not answer within ``pipeline_parallel_timeout`` (it hangs)."""


def layer_ranges(num_layers: int, size: int, split: str | None = None) -> list[range]:
    """The decoder layers of each of ``size`` shards: contiguous, in order, covering
    ``range(num_layers)``.

    Raises:
        ExecuteConfigError: the even split does not divide (the error names the count, the
            sizes that divide it and how to give an explicit split), or the explicit
            ``split`` has another number of shards, does not add up to ``num_layers``, or
            there are more shards than layers.
    """
    counts = parse_split(split)
    if size > num_layers:
        raise ExecuteConfigError(
            "pipeline_parallel_size",
            f"is {size}, but the model has {num_layers} decoder layers: each shard needs one",
        )
    if counts is None:
        if num_layers % size:
            sizes = ", ".join(str(n) for n in range(1, num_layers + 1) if num_layers % n == 0)
            raise ExecuteConfigError(
                "pipeline_parallel_size",
                f"{size} does not divide the model's {num_layers} decoder layers; sizes that "
                f"do: {sizes}; or give pipeline_parallel_split (layer counts per shard, such "
                f"as {_example(num_layers, size)})",
            )
        counts = (num_layers // size,) * size
    if len(counts) != size:
        raise ExecuteConfigError(
            "pipeline_parallel_split",
            f"names {len(counts)} shards ({','.join(map(str, counts))}), but "
            f"pipeline_parallel_size is {size}",
        )
    if sum(counts) != num_layers:
        raise ExecuteConfigError(
            "pipeline_parallel_split",
            f"({','.join(map(str, counts))}) adds up to {sum(counts)} layers, but the model has "
            f"{num_layers}",
        )
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _example(num_layers: int, size: int) -> str:
    base, extra = divmod(num_layers, size)
    return "'" + ",".join(str(base + (1 if i < extra else 0)) for i in range(size)) + "'"


def check_pipeline_parallel(
    hf_config: Any, size: int, split: str | None = None, model: str = "the model"
) -> list[range]:
    """Refuse, before loading, a pipeline-parallel layout the model cannot take.

    Returns:
        The shards' layer ranges (:func:`layer_ranges`).

    Raises:
        ExecuteConfigError: the model type is not one whose decoder a shard can start midway
            (:data:`PIPELINE_MODEL_TYPES`), or the split does not fit its layer count.
    """
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_layers = int(text.num_hidden_layers)
    if size == 1 and split is None:
        return [range(num_layers)]
    model_type = str(getattr(text, "model_type", "?"))
    if model_type not in PIPELINE_MODEL_TYPES:
        raise ExecuteConfigError(
            "pipeline_parallel_size",
            f"is {size}, but {model}'s model type {model_type!r} is not one actorline splits "
            f"into layer ranges (it does: {', '.join(PIPELINE_MODEL_TYPES)})",
        )
    return layer_ranges(num_layers, size, split)

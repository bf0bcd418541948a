"""The ``prefill_decode`` option (``--prefill-decode P:D``): how it is read and what it does
not combine with (docs/parallelism.md, "Disaggregated prefill and decode"). The router and
the engines' two ends are :mod:`stages.disaggregate`, :mod:`stages.execute.kv_links` (the
direct link between a prefill and a decode engine's execute stages, wired by
:func:`pipeline.engine.presets.llm_pipeline`) and :mod:`stages.execute.kv_blocks`.

Pure: no asyncio, no torch.
"""

from __future__ import annotations

from typing import Any

from pipeline.engine.option_fields import refuse_clashes

__all__ = ["PrefillDecode", "check_prefill_decode", "parse_prefill_decode"]

#: ``(P, D)``: P prefill engines and D decode engines
PrefillDecode = tuple[int, int]


def parse_prefill_decode(value: Any) -> PrefillDecode | None:
    """``value`` as ``(P, D)``: None, a pair of integers >= 1, or its text ``"P:D"``.

    Raises:
        ValueError: anything else, naming the option and the value.
    """
    if value is None:
        return None
    parts: Any = value
    if isinstance(value, str):
        parts = value.split(":")
        try:
            parts = [int(part) for part in parts]
        except ValueError:
            parts = None
    if (
        isinstance(parts, (tuple, list))
        and len(parts) == 2
        and all(type(part) is int and part >= 1 for part in parts)
    ):
        return (parts[0], parts[1])
    raise ValueError(
        "prefill_decode must be None or (P, D), prefill and decode engines, integers >= 1 "
        f"(the flag's 'P:D', such as '1:1'), got {value!r}"
    )


def check_prefill_decode(options: Any) -> None:
    """Refuse what ``prefill_decode`` does not combine with (not built yet), one line each.

    Raises:
        ValueError: naming the option it clashes with and why.
    """
    if options.prefill_decode is None:
        return
    prefill, decode = options.prefill_decode
    if options.data_parallel_size > 1:
        raise ValueError(
            f"prefill_decode {prefill}:{decode} runs P + D engine replicas in place of "
            f"data_parallel_size ({options.data_parallel_size}): give one of the two"
        )
    clashes = (
        ("pipeline_parallel_size > 1", options.pipeline_parallel_size > 1),
        ("null_model (no KV to move)", options.null_model),
        ("enable_lora", options.enable_lora),
        ("speculative_config", options.speculative_config is not None),
        ("enable_prefix_caching off (the decode engine imports the blocks into its prefix "
         "cache)", not options.enable_prefix_caching),
        ("transport 'memory' (every stage in the calling process; use 'zmq' or 'grpc')",
         not options.split_processes),
    )  # fmt: skip
    refuse_clashes(
        f"prefill_decode {prefill}:{decode}", clashes, "Disaggregated prefill and decode"
    )

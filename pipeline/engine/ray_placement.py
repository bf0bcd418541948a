"""Where an engine's hosts go on a Ray cluster (docs/parallelism.md, "Pipeline parallelism on
Ray"): each replica is one placement group whose bundle k is its pipeline shard k (the engine
host and its tensor-parallel ranks, then each later shard's host and its ranks: PP x TP), a
draft host placed apart a bundle of its own after them; placed by ``ray_placement_strategy``;
``ray_shard_resources`` pins each pipeline shard's bundle to a node that has a resource;
with ``prefill_decode``, ``ray_prefill_decode_resources`` pins every bundle of the prefill
engines' groups to one resource and the decode engines' to another (docs/parallelism.md,
"Disaggregated prefill and decode on Ray").

- **A shard is one bundle.** Its tensor-parallel ranks' actors all take their resources from
  it (one host's resources times the ranks), so Ray keeps every rank of a shard on one node
  whatever the strategy: the all-reduces stay on the node's loopback, and only the pipeline's
  hops (one hidden state per step) cross nodes. A strategy acts across shards: ``STRICT_SPREAD``
  puts each shard on a node of its own, never a shard's ranks apart (vLLM's Ray executor keeps
  a pipeline stage's TP workers together too, by bundle order on a node:
  vllm/executor/ray_utils.py, ``initialize_ray_cluster``; Ray places several actors in one
  bundle when its resources hold them all).

- **Strategy.** ``auto`` keeps an engine without pipeline parallelism on one node
  (``STRICT_PACK``, the ranks of a tensor-parallel group meet over the node's loopback
  bandwidth), and packs a pipeline-parallel one with ``PACK``: one node where the shards fit,
  else several, which is what vLLM's Ray executor asks for its placement group
  (vllm/executor/ray_utils.py, ``initialize_ray_cluster``). ``SPREAD`` and ``STRICT_SPREAD``
  are Ray's own: bundles on different nodes (best effort, or refused where there are too few).
- **Pinning.** A shard whose entry names a resource asks for :data:`PIN_AMOUNT` of it in each
  of its bundles, so the bundle lands on a node that has it: a custom resource given to the
  node (``ray start --resources '{"gpu_box_2": 1}'``) or the ``node:IP`` resource Ray gives
  every node (the way vLLM pins its driver's bundle to the driver's node, also
  vllm/executor/ray_utils.py). A tiny amount, so that every host of a node fits under a
  resource of 1.

Plain data: nothing here talks to Ray; the runtime creates the groups
(:mod:`pipeline.runtime.ray_hosts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.runtime.ray_hosts import PLACEMENT_STRATEGIES

__all__ = [
    "PIN_AMOUNT",
    "PLACEMENT_STRATEGIES",
    "check_ray_placement",
    "engine_role_pin",
    "group_bundles",
    "parse_shard_resources",
    "placement_strategy",
    "shard_bundle",
]

#: how much of a pinning resource each bundle of a pinned shard asks for
PIN_AMOUNT = 0.001


def parse_shard_resources(
    text: str | None, option: str = "ray_shard_resources", per: str = "shard"
) -> tuple[str, ...] | None:
    """``"a,,node:10.0.0.5"`` → ``("a", "", "node:10.0.0.5")`` (an empty entry: any node);
    ``option`` and ``per`` name the option and what each entry pins in the errors.

    Raises:
        ValueError: not a string, an entry with whitespace, or every entry empty.
    """
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{option} must be comma-separated resource names, got {text!r}")
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if any(char.isspace() for char in name):
            raise ValueError(f"{option}: {name!r} is not a Ray resource name (it has whitespace)")
    if not any(names):
        raise ValueError(
            f"{option} {text!r} names no resource: give one per {per}, such as "
            "'node:10.0.0.5,gpu_box_2' (an empty entry: any node)"
        )
    return names


def engine_role_pin(options: Any, replica: int) -> str:
    """The resource every bundle of engine replica ``replica`` asks for besides: with
    ``prefill_decode=(P, D)``, ``ray_prefill_decode_resources``' first entry for a prefill
    engine (replicas 0..P-1), its second for a decode engine ("": none)."""
    names = _role_resources(options)
    if names is None or options.prefill_decode is None:
        return ""
    return names[0] if replica < options.prefill_decode[0] else names[1]


def _role_resources(options: Any) -> tuple[str, ...] | None:
    return parse_shard_resources(
        options.ray_prefill_decode_resources,
        "ray_prefill_decode_resources",
        "role (prefill, then decode)",
    )


def check_ray_placement(options: Any) -> None:
    """The rules of ``ray_placement_strategy`` and ``ray_shard_resources`` across the other
    engine options (``options``: an EngineOptions).

    Raises:
        ValueError: either is given without Ray, or the resources do not name one entry per
            pipeline shard.
    """
    strategy, resources = options.ray_placement_strategy, options.ray_shard_resources
    roles = options.ray_prefill_decode_resources
    if not options.on_ray:
        for name, given in (("ray_placement_strategy", strategy != "auto"),
                            ("ray_shard_resources", resources is not None),
                            ("ray_prefill_decode_resources", roles is not None)):  # fmt: skip
            if given:
                raise ValueError(
                    f"{name} places the engine's hosts on Ray's nodes, but they are not on "
                    "Ray: give ray (--ray [ADDRESS]) or ray_address too"
                )
    names = parse_shard_resources(resources)
    if names is not None and len(names) != options.pipeline_parallel_size:
        raise ValueError(
            f"ray_shard_resources names {len(names)} shards ({resources}), but "
            f"pipeline_parallel_size is {options.pipeline_parallel_size}: give one resource "
            "per shard (an empty entry: any node)"
        )
    pair = _role_resources(options)
    if pair is not None and options.prefill_decode is None:
        raise ValueError(
            f"ray_prefill_decode_resources ({roles}) pins prefill and decode engines, but "
            "there are none: give prefill_decode (--prefill-decode P:D) too"
        )
    if pair is not None and len(pair) != 2:
        raise ValueError(
            f"ray_prefill_decode_resources names {len(pair)} resources ({roles}): give two, "
            "the prefill engines' then the decode engines' (an empty entry: any node)"
        )


def placement_strategy(strategy: str, pipeline_parallel_size: int) -> str:
    """The Ray strategy of each replica's placement group (``auto`` resolved)."""
    if strategy != "auto":
        return strategy
    return "PACK" if pipeline_parallel_size > 1 else "STRICT_PACK"


def shard_bundle(bundle: Mapping[str, float], resource: str) -> dict[str, float]:
    """``bundle`` asking besides for :data:`PIN_AMOUNT` of ``resource`` (none: as it is)."""
    pinned = dict(bundle)
    if resource:
        pinned[resource] = PIN_AMOUNT
    return pinned


def group_bundles(
    shards: Sequence[tuple[str, int]],
    apart: Sequence[str],
    bundle: Mapping[str, float],
    pins: Sequence[str],
    role: str = "",
) -> tuple[tuple[dict[str, float], ...], dict[str, int]]:
    """One replica's placement group: bundle k holds pipeline shard k's hosts (``shards``:
    ``(host, shard)`` for every host of every shard, its tensor-parallel ranks included), each
    host's ``bundle`` times their count, pinned to ``pins[k]`` (:func:`shard_bundle`); then
    one bundle per host of ``apart`` (a draft host), pinned as shard 0. Every bundle is
    pinned to ``role`` besides (:func:`engine_role_pin`; "": not).

    Returns:
        The bundles, and each host's bundle index.
    """
    counts: dict[int, int] = {}
    index: dict[str, int] = {}
    for host, shard in shards:
        counts[shard] = counts.get(shard, 0) + 1
        index[host] = shard
    bundles = [
        shard_bundle(shard_bundle(_times(bundle, counts[shard]), pins[shard]), role)
        for shard in sorted(counts)
    ]
    for host in apart:
        index[host] = len(bundles)
        bundles.append(shard_bundle(shard_bundle(bundle, pins[0]), role))
    return tuple(bundles), index


def _times(bundle: Mapping[str, float], count: int) -> dict[str, float]:
    """``bundle``'s resources ``count`` times over."""
    return {name: amount * count for name, amount in bundle.items()}

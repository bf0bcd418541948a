"""Pipeline x tensor parallelism (``docs/architecture.md`` §8, docs/parallelism.md
"Pipeline x tensor parallelism"): each pipeline shard is a tensor-parallel group of its own.

Shard 0's group is the execute stage and its ranks, exactly as without pipeline parallelism.
Shard ``k`` > 0's rank 0 is its :class:`~stages.execute.pp_stage.PipelineShardStage`: it
hosts the group's rendezvous (:func:`shard_group`, a ``TCPStore`` of its own, so the groups
never meet) and sends its ranks (stages ``<execute>_pp<k>_tp<r>`` on hosts ``<engine>_pp<k>_tp<r>``,
``pipeline.engine.presets``) the rendezvous, then each step it receives. The groups are
joined by the pipeline's ordinary links only: the all-reduces stay inside a shard (gloo on
CPU), and between shards one hidden state per step goes from rank 0 to rank 0, as vLLM's
``vllm/distributed/parallel_state.py`` lays out its TP groups inside each PP stage (there with
point-to-point sends between the stages' ranks; here a message over the link).
"""

from __future__ import annotations

from typing import Any

from stages.execute.config import ExecuteConfig
from stages.execute.rank_messages import RENDEZVOUS_HOST, Rendezvous

__all__ = ["shard_group"]


def shard_group(config: ExecuteConfig) -> tuple[Rendezvous | None, Any]:
    """A pipeline shard's side of its tensor-parallel group (``config.tensor_parallel_size``
    ranks): the rendezvous its ranks meet at and the ``TCPStore`` behind it, which the shard
    keeps as long as the group; ``(None, None)`` without tensor parallelism. Also gives the
    calling thread (the shard's step thread) its share of the cores.
    """
    size = config.tensor_parallel_size
    if size == 1:
        return None, None
    import torch

    from stages.execute.tensor_parallel import host_rendezvous, rendezvous_host, threads_per_rank

    torch.set_num_threads(threads_per_rank(size))
    store, rendezvous = host_rendezvous(
        rendezvous_host(RENDEZVOUS_HOST), size, config.tensor_parallel_timeout
    )
    return rendezvous, store

"""Tensor parallelism for the model runner: a transformers model split over N ranks joined by
``torch.distributed`` (gloo on CPU, NCCL on CUDA), Megatron-style.

What each rank holds (``docs/architecture.md`` §8):

- **column-parallel** linears (q/k/v, gate/up: "colwise" in the model's
  ``base_model_tp_plan``) keep rows ``[r * n / N, (r + 1) * n / N)`` of their weight, so rank
  ``r`` computes its own query heads, KV heads and MLP columns; its KV cache holds its own KV
  heads only;
- **row-parallel** linears (o, down: "rowwise") keep the matching columns and produce a
  partial sum, which one all-reduce per module turns into the full output (2 per layer);
- embeddings, norms and the LM head are whole on every rank; only rank 0 computes the LM head
  and samples.

The model's own plan says which module is which (transformers declares it for Llama, Qwen,
Mistral, ...); the slicing and the all-reduces are ours, after vLLM's
``vllm/model_executor/layers/linear.py`` (``ColumnParallelLinear``, ``RowParallelLinear``) and
``vllm/distributed/parallel_state.py`` (one group per engine, rank 0 drives). A model whose
head counts do not divide by N is refused before any weight is read
(:func:`check_tensor_parallel`).

Rank 0 is the execute stage: it owns the allocator and block tables, and each step sends the
other ranks a :class:`ShardStep` (the packed batch's tokens, positions and block tables), once
per step, not per layer. The group is made without the process-global default group (so
several engines can live in one process); it is joined through a ``TCPStore`` that rank 0
hosts (:class:`Rendezvous`). A collective that fails (a rank died) or waits past
``timeout`` (a rank hangs) raises :class:`TensorParallelError`; while the ranks load (their
probes run collectives between uneven amounts of work, such as sizing the KV cache) a
collective may wait :data:`JOIN_TIMEOUT` instead.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stages.execute.config import ExecuteConfigError
from stages.execute.rank_messages import Rendezvous, ShardStep

__all__ = [
    "JOIN_TIMEOUT",
    "Rendezvous",
    "ShardStep",
    "TensorParallelError",
    "TensorParallelGroup",
    "check_tensor_parallel",
    "host_rendezvous",
    "install_all_reduces",
    "rank_device",
    "rendezvous_host",
    "shard_model",
    "threads_per_rank",
    "valid_tensor_parallel_sizes",
]

logger = logging.getLogger("actorline.execute")

#: seconds every rank may take to load its shard before the group forms (the slowest rank
#: on a loaded machine reads and slices the whole checkpoint)
JOIN_TIMEOUT = 600.0
_COLWISE = "colwise"
_ROWWISE = "rowwise"
_STORE_PREFIX = "actorline-tp"


class TensorParallelError(RuntimeError):
    """A tensor-parallel collective failed: another rank died (its connection closed) or did
    not take part within the group's timeout (it hangs)."""


def valid_tensor_parallel_sizes(hf_config: Any) -> list[int]:
    """The sizes that split ``hf_config``'s query heads, KV heads and MLP width evenly."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    width = int(getattr(text, "intermediate_size", 0) or 0)
    common = math.gcd(math.gcd(heads, kv_heads), width) if width else math.gcd(heads, kv_heads)
    return [size for size in range(1, common + 1) if common % size == 0]


def check_tensor_parallel(hf_config: Any, size: int, model: str = "the model") -> None:
    """Refuse, before loading, a tensor-parallel ``size`` the model cannot be split by.

    Raises:
        ExecuteConfigError: ``size`` does not divide the query heads, the KV heads or the MLP
            width (the error gives the numbers and the sizes that work), or the model
            declares no tensor-parallel plan.
    """
    if size == 1:
        return
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    width = int(getattr(text, "intermediate_size", 0) or 0)
    if heads % size or kv_heads % size or (width and width % size):
        sizes = ", ".join(map(str, valid_tensor_parallel_sizes(hf_config)))
        raise ExecuteConfigError(
            "tensor_parallel_size",
            f"{size} does not divide {model}'s {heads} query heads and {kv_heads} KV heads"
            + (f" (MLP width {width})" if width else "")
            + f": each rank must hold whole heads; sizes that work: {sizes}",
        )
    plan = _tp_plan(text)
    if not plan:
        raise ExecuteConfigError(
            "tensor_parallel_size",
            f"is {size}, but model type {getattr(text, 'model_type', '?')!r} declares no "
            "tensor-parallel plan (base_model_tp_plan) saying which linears to split",
        )
    unsupported = sorted({style for style in plan.values() if style not in (_COLWISE, _ROWWISE)})
    if unsupported:
        raise ExecuteConfigError(
            "tensor_parallel_size",
            f"is {size}, but model type {getattr(text, 'model_type', '?')!r} splits modules "
            f"as {unsupported}; actorline splits only 'colwise' and 'rowwise' linears",
        )


def _tp_plan(text_config: Any) -> dict[str, str]:
    return dict(getattr(text_config, "base_model_tp_plan", None) or {})


def _plan_pattern(key: str) -> re.Pattern[str]:
    """A plan key (``layers.*.self_attn.q_proj``) as a pattern over module names."""
    parts = (r"\d+" if part == "*" else re.escape(part) for part in key.split("."))
    return re.compile(r"\.".join(parts))


def shard_model(model: Any, rank: int, size: int) -> list[str]:
    """Cut ``model``'s linears to rank ``rank``'s share of ``size`` (see the module
    docstring), in place, before anything repacks them.

    Returns:
        The names (from the model's root) of the row-parallel modules, whose outputs need an
        all-reduce (:func:`install_all_reduces`).

    Raises:
        ExecuteConfigError: the plan names no module of the model, or a split module is not a
            plain linear.
    """
    text = model.config.get_text_config()
    plan = _tp_plan(text)
    base_name, base = _base_model(model)
    patterns = [(_plan_pattern(key), style) for key, style in plan.items()]
    rowwise: list[str] = []
    matched = 0
    for name, module in base.named_modules():
        style = next((s for pattern, s in patterns if pattern.fullmatch(name)), None)
        if style is None:
            continue
        if not isinstance(module, torch.nn.Linear):
            raise ExecuteConfigError(
                "tensor_parallel_size",
                f"cannot split {name} ({type(module).__name__}): only nn.Linear modules split",
            )
        matched += 1
        full = f"{base_name}.{name}" if base_name else name
        if style == _COLWISE:
            _keep_rows(module, rank, size)
        else:
            _keep_columns(module, rank, size)
            rowwise.append(full)
    if not matched:
        raise ExecuteConfigError(
            "tensor_parallel_size", "the model's tensor-parallel plan matches none of its modules"
        )
    return rowwise


def _base_model(model: Any) -> tuple[str, Any]:
    """The decoder the plan's keys are relative to, and its name in ``model``."""
    prefix = getattr(model, "base_model_prefix", "") or "model"
    base = getattr(model, prefix, None)
    if isinstance(base, torch.nn.Module):
        return prefix, base
    return "", model


def _slice(length: int, rank: int, size: int) -> slice:
    share = length // size
    return slice(rank * share, (rank + 1) * share)


def _keep_rows(linear: torch.nn.Linear, rank: int, size: int) -> None:
    rows = _slice(linear.out_features, rank, size)
    linear.weight = torch.nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: torch.nn.Linear, rank: int, size: int) -> None:
    columns = _slice(linear.in_features, rank, size)
    linear.weight = torch.nn.Parameter(
        linear.weight.detach()[:, columns].contiguous(), requires_grad=False
    )
    if linear.bias is not None and rank != 0:
        # NOTE: the all-reduce adds every rank's output; the bias belongs in one of them.
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = linear.weight.shape[1]


def rank_device(
    device: torch.device, rank: int, assigned_gpus: Sequence[str] | None = None
) -> torch.device:
    """The device of rank ``rank`` when the engine runs on ``device``.

    ``assigned_gpus``: the GPUs Ray assigned this rank's host (None: as this process's
    Ray host says, :func:`~pipeline.runtime.ray_hosts.host_gpu_ids`). Where there are
    none (a local process, or a Ray actor that reserved no GPU, which sees the node's GPUs)
    every rank sees the same GPUs and rank ``r`` takes the ``r``-th after ``device``'s. Where
    there are (each rank's Ray actor reserved its own, ``ray_num_gpus``), Ray made only those
    visible, numbered from 0, so every rank takes ``device``'s index among them (``cuda:0``
    for ``cuda``), not ``cuda:<rank>``, which its process does not see (docs/parallelism.md).

    Raises:
        ExecuteConfigError: ``device`` names a GPU beyond those Ray assigned.
    """
    if device.type != "cuda":
        return device
    index = device.index or 0
    if assigned_gpus is None:
        from pipeline.runtime.ray_hosts import host_gpu_ids

        assigned_gpus = host_gpu_ids()
    if not assigned_gpus:
        return torch.device("cuda", index + rank)
    if index >= len(assigned_gpus):
        raise ExecuteConfigError(
            "device",
            f"is {device}, but Ray assigned rank {rank}'s host {len(assigned_gpus)} GPU(s) "
            f"({', '.join(assigned_gpus)}), visible as cuda:0..cuda:{len(assigned_gpus) - 1}",
        )
    return torch.device("cuda", index)


def rendezvous_host(local: str = "127.0.0.1") -> str:
    """Where rank 0's ``TCPStore`` tells the other ranks to meet it: on a Ray host, its
    node's IP (:func:`~pipeline.runtime.ray_hosts.host_node_ip`); elsewhere ``local`` (the
    loopback: the ranks are processes of this machine).

    NOTE: the LLM presets STRICT_PACK a replica's ranks on one node, where the loopback would
    do; the node's IP is what any rank can reach wherever a placement puts it, like the host's
    own links (docs/parallelism.md), and exposes nothing more: the store listens on every
    interface whatever address it is given, which only tells the ranks where to connect.
    """
    from pipeline.runtime.ray_hosts import host_node_ip

    return host_node_ip() or local


def threads_per_rank(size: int) -> int:
    """Torch threads for each of ``size`` ranks sharing this machine's cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // size)


def host_rendezvous(host: str, world_size: int, timeout: float) -> tuple[Any, Rendezvous]:
    """Rank 0's side: a ``TCPStore`` on ``host`` (a port the OS picks) and the
    :class:`Rendezvous` that tells the other ranks where it is. Keep the store alive as long
    as the group."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=JOIN_TIMEOUT),
        wait_for_workers=False,
    )
    return store, Rendezvous(host, int(store.port), world_size, timeout)


class TensorParallelGroup:
    """One engine's ranks: all-reduce, timed. Made by :meth:`join` on every rank."""

    def __init__(
        self,
        group: Any,
        rank: int,
        size: int,
        device: torch.device,
        store: Any,
        timeout: float = JOIN_TIMEOUT,
    ) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.size = size
        self.device = device
        self._group = group
        self._store = store  # the group reads through it; keep it alive
        self._options = dist.AllreduceOptions()  # a sum (the default reduceOp)
        self._step_timeout = timeout
        self._options.timeout = datetime.timedelta(seconds=JOIN_TIMEOUT)
        #: seconds spent in collectives since the last :meth:`take_seconds`
        self.seconds = 0.0
        self.collectives = 0

    @classmethod
    def join(
        cls, rendezvous: Rendezvous, rank: int, device: torch.device, *, store: Any = None
    ) -> TensorParallelGroup:
        """Meet the other ranks at ``rendezvous`` (rank 0 passes the ``store`` it hosts)
        once each has loaded its shard, and form the group.

        Raises:
            TensorParallelError: the other ranks did not all arrive within
                :data:`JOIN_TIMEOUT`.
        """
        import torch.distributed as dist

        size = rendezvous.world_size
        if store is None:
            store = dist.TCPStore(
                rendezvous.host,
                rendezvous.port,
                size,
                is_master=False,
                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT),
            )
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        prefixed.set(f"ready/{rank}", "1")
        try:
            prefixed.wait(
                [f"ready/{other}" for other in range(size)],
                datetime.timedelta(seconds=JOIN_TIMEOUT),
            )
        except RuntimeError as exc:
            raise TensorParallelError(
                f"rank {rank}: the other tensor-parallel ranks did not arrive within "
                f"{JOIN_TIMEOUT:g} s: {exc}"
            ) from exc
        timeout = datetime.timedelta(seconds=rendezvous.timeout)
        group: Any
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        logger.info("execute: tensor-parallel rank %d of %d joined (%s)", rank, size, device)
        return cls(group, rank, size, device, store, rendezvous.timeout)

    def steady(self) -> None:
        """Loading is over: from now on a collective waits at most the rendezvous' timeout."""
        self._options.timeout = datetime.timedelta(seconds=self._step_timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place where it is contiguous.

        Returns:
            The summed tensor (``tensor`` itself, or a contiguous copy of it).

        Raises:
            TensorParallelError: the collective failed or timed out.
        """
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self._collective("all-reduce", lambda: self._group.allreduce([tensor], self._options))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (the same shape on each), in rank order.

        Raises:
            TensorParallelError: the collective failed or timed out.
        """
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        # (the overload that takes the timeout: its options class is not in
        # torch.distributed's namespace)
        self._collective(
            "all-gather", lambda: self._group.allgather(parts, tensor, self._options.timeout)
        )
        return parts

    def _collective(self, name: str, start: Callable[[], Any]) -> None:
        """Run the collective ``start`` begins and wait for it, counted and timed.

        Raises:
            TensorParallelError: it failed or timed out (naming ``name`` and this rank).
        """
        began = time.perf_counter()
        try:
            start().wait()
        except RuntimeError as exc:
            raise TensorParallelError(
                f"tensor-parallel {name} failed on rank {self.rank} of {self.size}: {exc}"
            ) from exc
        finally:
            self.seconds += time.perf_counter() - began
            self.collectives += 1

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a collective: every rank calls it)."""
        votes = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        return bool(self.all_reduce(votes).item() > 0)

    def take_seconds(self) -> float:
        """Seconds spent in collectives since the last call (then zero again)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def install_all_reduces(model: Any, names: list[str], group: TensorParallelGroup) -> None:
    """Sum the outputs of the row-parallel modules ``names`` over ``group`` (a forward hook
    on each; install after the linears are repacked, which replaces modules)."""

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output)

    for name in names:
        model.get_submodule(name).register_forward_hook(hook)

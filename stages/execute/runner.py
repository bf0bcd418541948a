"""The model runner: loads an HF causal LM with paged attention, owns the KV cache, the block
allocator and each request's sampling state, and runs one :class:`SchedulerStep` at a time.

Synchronous on purpose: the execute stage calls it on a worker thread, off the event loop.

A request's *known tokens* are its prompt plus its sampled outputs. A chunk
``[start, start + n)`` computes those positions (less any already in the cache) and, when it
reaches the end of the known tokens, samples the next token. A chunk starting at 0 (a new or
resumed request) first looks its tokens up in the prefix cache. Step flow after vLLM v1
(``vllm/v1/worker/gpu_model_runner.py``: ``_update_states``, ``_prepare_inputs``,
``execute_model``) and nano-vllm (``nanovllm/engine/model_runner.py``).

With tensor parallelism (``tensor_parallel_size`` > 1, :mod:`stages.execute.tensor_parallel`)
every rank runs a runner over its shard of the model. Rank 0's runner does everything above;
a step is :meth:`ModelRunner.prepare` (bookkeeping and the packed batch, whose
:class:`~stages.execute.tensor_parallel.ShardStep` the execute stage sends the other ranks),
then :meth:`ModelRunner.run` (the forward pass and sampling). The other ranks run
:meth:`ModelRunner.run_shard` on each ShardStep: the same forward pass over their shard,
without LM head or sampling.

A step's batch (the requests held, each chunk's share, the packing, the prepared step) is
:mod:`stages.execute.step_batch`; the paths a packed batch runs on (step graph, decode graphs,
the model's modules) and their building at load are :mod:`stages.execute.forward_paths`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.runtime import settings
from stages.execute.allocator import BlockAllocator
from stages.execute.attention import (
    DecodeAttentionMode,
    KVCache,
    UnsupportedModelError,
    build_step_metadata,
    check_model_config,
    enable_paged_attention,
    forward_context,
    prefill_in_bf16,
    survey_layers,
)
from stages.execute.bf16 import (
    BF16GemmKernel,
    bf16_gemm_kernel,
    use_bf16_linears,
)
from stages.execute.bookkeeping import (
    PlanReport,
    StepError,
    commit_chunk,
    plan_chunks,
    release,
    release_behind_windows,
    step_result,
    validate_step,
)
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.cpu import release_free_memory, tune_allocator, use_cpu_linears
from stages.execute.flex import use_flex
from stages.execute.forward_paths import ForwardPaths
from stages.execute.fused import use_fused_ops
from stages.execute.grammar_mask import grammar_rows
from stages.execute.kv_blocks import (
    export_planned,
    export_rank_blocks,
    import_moved_blocks,
    import_rank_blocks,
    plan_exports,
    with_moved_blocks,
)
from stages.execute.llama import load_native_llama
from stages.execute.loading import (
    check_paged_attention,
    decode_mode,
    layer_shape,
    load_key,
    probe_token_ids,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from stages.execute.lora import LoRABank, acquire_adapter
from stages.execute.lora_shard import lora_shard_of, shard_lora_rows
from stages.execute.model_impl import NativeConfig, eos_token_ids, model_config
from stages.execute.model_length import resolve_model_length
from stages.execute.native import (
    PagedDecodeKernel,
    fused_ops_kernel,
    packed_gemm_kernel,
)
from stages.execute.pipeline_parallel import drop_embeddings
from stages.execute.pooling import Pooler, capture_hidden_states, matryoshka_dimensions
from stages.execute.pp_load import load_transformers_model, shard_part, survey_model
from stages.execute.pp_split import check_pipeline_parallel
from stages.execute.probe_cache import checks_passed, record_passed
from stages.execute.prompt_scores import (
    fill_prompt_rows,
    new_prompt_scores,
    prompt_rows,
    score_prompt_rows,
)
from stages.execute.quant.apply import quantize_model, weight_bytes
from stages.execute.sampler import Sampler, SampleResult, new_sampling_state
from stages.execute.speculative import (
    draft_rows,
    stage_drafts,
    unstage_drafts,
    verify_drafts,
)
from stages.execute.step_batch import (
    PreparedStep,
    RunnerRequest,
    Work,
    pack,
    shard_step,
)
from stages.execute.step_graph import (
    StepGraph,
)
from stages.execute.step_graph_lora import StepGraphLoRA, lora_tables
from stages.execute.tensor_parallel import (
    Rendezvous,
    ShardStep,
    TensorParallelGroup,
    check_tensor_parallel,
    install_all_reduces,
    rank_device,
    shard_model,
)
from stages.kv_transfer import KvBlocks
from stages.lora import lora_cache_key
from stages.messages import (
    EngineInfo,
    EngineRequest,
    Logprobs,
    SchedulerStep,
    StepResult,
)
from stages.models import quiet_transformers, resolve_model

__all__ = ["ModelRunner", "PreparedStep", "StepError"]

logger = logging.getLogger("actorline.execute")


class ModelRunner(ForwardPaths):
    """Runs the model for the execute stage (see the module docstring).

    Args:
        config: what to load and how.
        force_static_decode: run decode-only steps through the static padded path of
            :mod:`stages.execute.cuda_graphs` even on CPU (uncaptured there). For tests.
        rank: this runner's tensor-parallel rank (0 drives; see the module docstring).
        rendezvous: where the ranks meet, with ``config.tensor_parallel_size`` > 1.
        store: rank 0's ``TCPStore`` behind ``rendezvous`` (rank 0 only).
        shard: this runner's pipeline-parallel shard (0, the first, drives; the others run
            :meth:`forward_layers` on what the shard before sends).
    """

    def __init__(
        self,
        config: ExecuteConfig,
        *,
        force_static_decode: bool = False,
        rank: int = 0,
        rendezvous: Rendezvous | None = None,
        store: Any = None,
        shard: int = 0,
    ) -> None:
        if config.tensor_parallel_size > 1 and rendezvous is None:
            raise ValueError("a tensor-parallel runner needs the ranks' rendezvous")
        if not 0 <= rank < config.tensor_parallel_size:
            raise ValueError(f"rank {rank} is outside [0, {config.tensor_parallel_size})")
        self.config = config
        self.rank = rank
        self.shard = shard
        self._rendezvous = rendezvous
        self._store = store
        self.group: TensorParallelGroup | None = None
        self._force_static_decode = force_static_decode
        self.model: Any = None
        self.kv_cache: KVCache | None = None
        #: with ``config.kv_export``: the prompts' blocks exported since the stage took them
        self.kv_exports: list[KvBlocks] = []
        self.allocator: BlockAllocator | None = None
        self.info: EngineInfo | None = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # activations
        self.kv_dtype = torch.float32  # the KV cache (kv_cache_dtype resolved at load)
        self._bf16: BF16GemmKernel | None = None  # bf16 weights on CPU (stages.execute.bf16)
        self.max_model_len = 0
        self._sampler: Sampler | None = None
        self._requests: dict[str, RunnerRequest] = {}
        self._eos_token_ids: tuple[int, ...] = ()
        self._decode_mode: DecodeAttentionMode = "grouped"
        self._flex = False  # attention_backend "flex" (stages.execute.flex)
        self._window: int | None = None  # bounds every layer: blocks behind it are freed
        self._decode_graphs: Any = None  # stages.execute.cuda_graphs.DecodeGraphs
        self._step_graph: StepGraph | None = None  # CPU decode steps in one native call
        self._step_graph_lora: StepGraphLoRA | None = None  # and their LoRA deltas
        self._pooler = Pooler(config.pooling_type, config.pooling_normalize)
        self.lora: LoRABank | None = None  # the adapters served, with enable_lora
        #: run every step of short chunks as decode rows on the step graph, prompt chunks too
        #: (the draft model's runner, stages/execute/drafter.py: its rounding need not match
        #: the module path's, and its catch-up chunks are a few tokens)
        self.chunks_as_rows = False

    # ----------------------------------------------------------------- loading
    def load(self) -> EngineInfo:
        """Load the model, check it is supported, allocate the KV cache.

        Returns:
            The engine's capacity (usable blocks, block size, max model length, ...).

        Raises:
            stages.models.ModelError: the model cannot be found or read.
            UnsupportedModelError: the model needs attention features paged attention lacks.
            ExecuteConfigError: the config does not fit the model or the machine (no CUDA,
                max_model_len too long, cache too small).
        """
        config = self.config
        parallel = config.tensor_parallel_size
        resolved = resolve_model(config.model)
        self.device = rank_device(resolve_device(config.device), self.rank)
        on_cpu = self.device.type == "cpu"
        if on_cpu and config.tune_allocator:
            tune_allocator()
        hf_config = model_config(resolved.path, config.model_impl)
        if config.model_impl == "native" and not isinstance(hf_config, NativeConfig):
            raise UnsupportedModelError(
                f"model_impl 'native': actorline's own model classes do not serve "
                f"{resolved.name} (see stages.execute.llama); use 'auto' or 'transformers'"
            )
        check_model_config(hf_config, config.max_model_len)
        check_tensor_parallel(hf_config, parallel, resolved.name)
        stages = config.pipeline_parallel_size
        ranges = check_pipeline_parallel(
            hf_config, stages, config.pipeline_parallel_split, resolved.name
        )
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self._bf16 = self._native_bf16()
        if self._bf16 is not None:
            # NOTE: loaded in bf16 (the weights rounded as transformers rounds them), computed
            # in fp32 over bf16 linears (stages.execute.bf16).
            logger.info("execute: bf16 weights on the native bf16 GEMM, fp32 activations")
        model: Any
        part = shard_part(ranges, self.shard)  # a pipeline shard loads its own tensors only
        if isinstance(hf_config, NativeConfig):
            model = load_native_llama(resolved.path, hf_config, self.dtype, part)
        else:
            quiet_transformers()
            model = load_transformers_model(resolved.path, hf_config, self.dtype, part)
        model.eval()
        model.to(self.device)
        if self._bf16 is not None:
            model.float()
            self.dtype = torch.float32
        self.model = model
        if config.seed is not None:
            torch.manual_seed(config.seed)

        rounds_inputs = False  # the linears round their inputs (int8 activations)
        if config.quantization is not None:
            if not on_cpu or self.dtype != torch.float32:
                raise ExecuteConfigError(
                    "quantization",
                    f"({config.quantization!r}) serves fp32 models on CPU (weight-only, fp32 "
                    f"activations); got {self.dtype} on {self.device}",
                )
            rounds_inputs = quantize_model(
                model, config.quantization, resolved.gguf, config.quant_activations,
                layer_offset=ranges[self.shard].start,
            ).int8_activations  # fmt: skip
        row_parallel = shard_model(model, self.rank, parallel) if parallel > 1 else []
        key = load_key(
            config, resolved.path, device=self.device, dtype=self.dtype,
            kv_dtype=resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self._bf16 is not None),
            bf16_weights=self._bf16 is not None, rank=self.rank,
        )  # fmt: skip
        verify = not checks_passed(settings.cache_dir(), key)
        fused = None
        if on_cpu and config.fused_ops and self.dtype == torch.float32:
            fused = fused_ops_kernel()
            if fused is not None:
                # NOTE: before the linears are packed (the fused gate/up projection is packed
                # straight from both weights) and before the all-reduces: a fused MLP keeps its
                # down_proj module, so the hook installed on it by name still sums its output.
                native = config.cpu_linears and config.native_linears
                use_fused_ops(model, packed_gemm_kernel() if native else None, fused, verify=verify)
        if on_cpu and config.cpu_linears:
            # NOTE: before the KV cache exists: repacking holds one weight twice for a moment.
            use_cpu_linears(model, native=config.native_linears, verify=verify)
        if self._bf16 is not None and not use_bf16_linears(model, self._bf16, verify=verify):
            raise ExecuteConfigError("dtype", "'bfloat16': the native bf16 GEMM failed its check")
        if config.enable_lora:
            # NOTE: after every linear took its final kind: the wrappers call whichever it is
            shard = lora_shard_of(model, self.rank, parallel)  # sharded like the linears
            self.lora = LoRABank.for_model(model, config, self.device, shard)
        if parallel > 1:
            # NOTE: every rank has loaded its shard before the group forms, so the first
            # collective never waits on a slow load (the group's timeout is for steps).
            assert self._rendezvous is not None
            self.group = TensorParallelGroup.join(
                self._rendezvous, self.rank, self.device, store=self._store
            )
            install_all_reduces(model, row_parallel, self.group)
            # NOTE: the load-time probe below runs the model, so all-reduces: the ranks must
            # agree whether to run it. Each read the probe cache on its own, and another
            # engine loading the same model at once (data-parallel replicas) can record its
            # pass between two ranks' reads; one rank probing alone would pair its
            # collectives with the other's first step.
            verify = self.group.any(verify)
        text_config = model.config.get_text_config()
        vocab_size = int(text_config.vocab_size)
        probe_ids = probe_token_ids(vocab_size, self.device)
        expected: torch.Tensor | None = None
        # NOTE: a pipeline shard cannot run the whole model to check its paged attention
        # against the model's own (docs/parallelism.md); its linears are still checked
        if verify and stages == 1:
            with torch.inference_mode():
                # The model's own attention, before paged attention replaces it.
                expected = model(input_ids=probe_ids, use_cache=False).logits[0].float()  # [8, V]
        enable_paged_attention(model)
        layers = survey_layers(
            survey_model(model, stages, self.dtype),
            probe_ids,
            config.max_model_len or (1 << 62),
        )
        if stages > 1 and self.shard > 0:
            drop_embeddings(model)
        shape = layer_shape(layers, text_config)
        num_layers, num_heads = int(text_config.num_hidden_layers), shape.num_heads
        num_kv_heads, head_dim = shape.num_kv_heads, shape.head_dim
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self._bf16 is not None)
        block_bytes = KVCache.bytes_per_block(
            # every shard sizes its blocks for the largest shard: the first shard's allocator
            # hands out block ids that every shard's cache must hold
            num_layers=max(len(layer_range) for layer_range in ranges),
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=self.kv_dtype,
        )
        if config.num_blocks is not None:
            usable_blocks = config.num_blocks
        else:
            usable_blocks = config.kv_cache_bytes_budget // block_bytes - 1
            if usable_blocks < 1:
                raise ExecuteConfigError(
                    "kv_cache_memory",
                    f"({config.kv_cache_bytes_budget} bytes) holds no KV block; one block "
                    f"takes {block_bytes} bytes (plus one reserved block)",
                )
        self.max_model_len, self._window = resolve_model_length(
            config.max_model_len,
            text_config,
            usable_blocks,
            config.block_size,
            [layers[index].window for index in sorted(layers)],
        )
        self.kv_cache = KVCache.allocate(
            num_layers=num_layers,
            num_blocks=usable_blocks + 1,
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.kv_cache.bf16_prefill = prefill_in_bf16(
            kv_dtype=self.kv_dtype,
            activations=self.dtype,
            device=self.device,
            native_bf16=self._bf16 is not None and self._bf16.native,
        )
        self.allocator = BlockAllocator(
            usable_blocks + 1,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            extra_hash_key=(
                f"{resolved.path}|{self.dtype}|{self._bf16 is not None}|{self.kv_dtype}".encode()
            ),
        )
        self._decode_mode = decode_mode(
            config.decode_attention,
            self.device,
            PagedDecodeKernel.supports(
                dtype=self.dtype,
                device=self.device,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                kv_dtype=self.kv_dtype,
            ),
        )
        self._flex = use_flex(config.attention_backend, self.device, config.block_size)
        if expected is not None:
            check_paged_attention(
                model, self.kv_cache, self.allocator, probe_ids, expected,
                num_layers=num_layers, decode_attention=self._decode_mode, flex=self._flex,
                max_model_len=self.max_model_len, device=self.device,
                weights_dtype=torch.bfloat16 if self._bf16 is not None else self.dtype,
                kv_dtype=self.kv_dtype, rounded_inputs=rounds_inputs,
            )  # fmt: skip
        self._step_graph = self._make_step_graph(layers, verify=expected is not None)
        self._step_graph_lora = lora_tables(self.lora, self._step_graph)
        # NOTE: a refused step graph records nothing: the next load checks everything again
        # rather than trusting a plan it would build unchecked.
        if expected is not None and (self._step_graph is not None or not self._wants_step_graph):
            record_passed(settings.cache_dir(), key, resolved.path)
        self._sampler = Sampler(
            vocab_size, self.device, argmax=fused.argmax if fused is not None else None
        )
        # NOTE: from the checkpoint's files, as transformers' generation config has them, for
        # either model class (actorline's own has no generation config object)
        self._eos_token_ids = eos_token_ids(resolved.path, hf_config.to_dict())
        self._decode_graphs = self._make_decode_graphs()
        self.info = EngineInfo(
            model=resolved.name,
            vocab_size=vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self._eos_token_ids,
            num_blocks=usable_blocks,
            block_size=config.block_size,
            dtype="bfloat16" if self._bf16 is not None else str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            kv_cache_bytes=self.kv_cache.nbytes,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=self._window,
            quantization=config.quantization,
            weight_bytes=weight_bytes(model),
            # NOTE: a pipeline-parallel engine's last shard sends back sampled tokens, not its
            # hidden states, so such an engine pools none: 0 refuses embedding requests
            embedding_size=0
            if self.config.pipeline_parallel_size > 1
            else int(text_config.hidden_size),
            pooling_type=config.pooling_type,
            matryoshka_dimensions=matryoshka_dimensions(resolved.path),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            lora_targets=self.lora.target_shapes() if self.lora is not None else (),
            step_graph_rows=self._step_graph.max_rows if self._step_graph is not None else 0,
            lora_layers=self.lora.num_layers if self.lora is not None else 0,
        )
        if on_cpu and config.tune_allocator:
            release_free_memory()
        if self.group is not None:
            self.group.steady()
        logger.info("execute: loaded %s (%s)", resolved.name, self.info)
        return self.info

    def _native_bf16(self) -> BF16GemmKernel | None:
        """The bf16 GEMM where this load runs bf16 weights natively on CPU (``dtype``
        bfloat16, the packed linears on, no quantization, the kernels built), else None."""
        config = self.config
        if (
            self.device.type != "cpu"
            or self.dtype != torch.bfloat16
            or not (config.cpu_linears and config.native_linears)
            or config.quantization is not None
            or packed_gemm_kernel() is None
        ):
            return None
        return bf16_gemm_kernel()

    @property
    def sampler(self) -> Sampler | None:
        """The sampler (None before :meth:`load`)."""
        return self._sampler

    @property
    def _heads(self) -> tuple[int, int]:
        """(rank, ranks): which tensor-parallel share of the KV heads this runner's cache holds."""
        return (self.rank, self.config.tensor_parallel_size)

    # ----------------------------------------------------------------- stepping
    def execute(self, step: SchedulerStep) -> StepResult:
        """Run one scheduler step (see :class:`~stages.messages.SchedulerStep` for the order:
        free finished and preempted, register new requests, compute chunks, sample):
        :meth:`prepare`, then :meth:`run`.

        Returns:
            The sampled tokens, cache state and counters; requests that did not get blocks
            are listed in ``preempted`` (their blocks freed, their sampling state kept).
            ``forward_seconds`` covers the forward pass and sampling.

        Raises:
            StepError: the step does not match the runner's state.
            RuntimeError: :meth:`load` was not called.
        """
        return self.run(self.prepare(step))

    def prepare(self, step: SchedulerStep) -> PreparedStep:
        """The bookkeeping half of :meth:`execute`: check the step, free, register, allocate
        each chunk's blocks and pack the batch (and its ShardStep, with tensor parallelism).

        Raises:
            StepError: the step does not match the runner's state (nothing changed then).
            RuntimeError: :meth:`load` was not called, or this is not rank 0.
        """
        allocator = self.allocator
        if allocator is None or self._sampler is None:
            raise RuntimeError("ModelRunner.load() must be called before execute()")
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} runs ShardSteps (run_shard), not steps")
        validate_step(step, self._requests, self.max_model_len)
        release(allocator, self._requests, step)
        self._pooler.forget((*step.finished, *step.preempted))
        for new_request in step.new_requests:
            self._register(new_request)
        written: list[Any] = []  # prefill/decode: blocks moved in (stages/execute/kv_blocks.py)
        import_moved_blocks(self.kv_cache, allocator, step.new_requests, self._heads, written)
        drafts = stage_drafts(self._requests, step.chunks)
        report = PlanReport()
        works: list[Work] = []
        chunks = plan_chunks(allocator, self._requests, step.chunks, report, step.spare_blocks)
        for request, start, end in chunks:
            works.append(Work(request, start, end, samples=end == request.num_tokens))
        unstage_drafts(self._requests, drafts, report.preempted)
        packed = pack(works, allocator) if works else None
        prepared = PreparedStep(step, works, report, packed, drafts=drafts)
        if packed is not None and (
            self.group is not None or self.config.pipeline_parallel_size > 1
        ):
            prepared.shard = shard_step(step.step_id, packed)
        if self.config.kv_export:
            prepared.kv_out = plan_exports(allocator, allocator.block_size, works)
        if self.group is not None:
            prepared.shard = with_moved_blocks(
                prepared.shard, step.step_id, written, prepared.kv_out
            )
        return prepared

    def run(self, prepared: PreparedStep) -> StepResult:
        """The compute half of :meth:`execute`: the forward pass over the packed batch (with
        tensor parallelism, together with the other ranks running ``prepared.shard``),
        sampling, and the chunks' commit to the prefix cache."""
        allocator, sampler = self.allocator, self._sampler
        assert allocator is not None and sampler is not None
        works = prepared.works
        request_ids: list[str] = []
        token_ids: list[int] = []
        logprob_ids: list[str] = []
        logprobs: list[Logprobs] = []
        prompt_logprobs: dict[str, tuple[Logprobs, ...]] = {}
        embeddings: dict[str, np.ndarray] = {}
        accepted_ids: dict[str, tuple[int, ...]] = {}
        forward_seconds = 0.0
        num_computed = sum(work.end - work.start for work in works)
        if prepared.packed is not None:
            began = time.perf_counter()
            # NOTE: embedding requests pool instead of sampling (stages.execute.pooling): a
            # step with any runs the module path, whose decoder output is captured
            pooled = [work for work in works if work.request.pooling is not None]
            sampling = [work for work in works if work.samples and work.request.pooling is None]
            kept = sampling or pooled[:1]
            scored = prompt_rows(
                [(w.request.prompt_scores, w.start, w.end, w.packed_end) for w in works]
            )
            # speculative decoding: the drafted works verify at their draft rows too
            drafts = prepared.drafts
            drafted = [w for w in sampling if w.request.request_id in drafts]
            verified = draft_rows(
                [(w.packed_end, len(drafts[w.request.request_id])) for w in drafted]
            )
            # NOTE: the decode graphs know nothing of LoRA; the step graph adds the deltas
            # where it serves them (stages.execute.step_graph_lora)
            module_path = bool(pooled) or (
                self._step_graph_lora is None and any(w.request.lora is not None for w in works)
            )
            remote = prepared.sampled
            result: SampleResult | None
            if remote is not None:  # the last pipeline shard sampled (stages.execute.pp_sampling)
                result = remote.result
                fill_prompt_rows(remote.prompt_logprobs, scored)
            else:
                with capture_hidden_states(self.model, enabled=bool(pooled)) as hidden:
                    logits = self._forward(
                        prepared.packed,
                        kept,
                        [*scored.packed_rows, *verified],
                        module_path=module_path,
                        token_rows=self.chunks_as_rows
                        or (
                            bool(drafted)
                            and all(
                                w.end - w.start == 1 or w.request.request_id in drafts
                                for w in works
                            )
                        ),
                    )  # [K + E + D, V]
                if pooled:
                    embeddings = self._pooler.pool(hidden, [(w.request, w) for w in pooled])
                extra = logits[len(kept) :]  # [E + D, V]
                if scored.packed_rows:
                    score_prompt_rows(extra[: len(scored.packed_rows)], scored)
                if drafted:
                    accepted_ids = verify_drafts(
                        sampler,
                        allocator,
                        [
                            logits[i]
                            for i, w in enumerate(sampling)
                            if w.request.request_id in drafts
                        ],
                        extra[len(scored.packed_rows) :],
                        drafted,
                        drafts,
                    )
                    for work in drafted:
                        request_ids.append(work.request.request_id)
                        token_ids.append(work.request.sampling.output_token_ids[-1])
                    plain = [
                        i for i, w in enumerate(sampling) if w.request.request_id not in drafts
                    ]
                    sampling = [sampling[i] for i in plain]
                    logits = logits[plain]  # [K - S, V]
                logits = logits[: len(kept)]  # [K, V]
                grammar = grammar_rows(
                    prepared.step,
                    [work.request.request_id for work in sampling],
                    sampler.vocab_size,
                    self.device,
                )
                tokens_of = [work.request.sampling for work in sampling]
                result = sampler.sample(logits, tokens_of, grammar) if sampling else None
            forward_seconds = time.perf_counter() - began
            for work, token_id, token_logprobs in zip(
                sampling,
                result.token_ids if result else (),
                result.logprobs if result else (),
                strict=True,
            ):
                work.request.sampling.output_token_ids.append(token_id)
                request_ids.append(work.request.request_id)
                token_ids.append(token_id)
                if token_logprobs is not None:
                    logprob_ids.append(work.request.request_id)
                    logprobs.append(token_logprobs)
                prompt_scores = work.request.prompt_scores
                if prompt_scores is not None and (entries := prompt_scores.take()) is not None:
                    prompt_logprobs[work.request.request_id] = entries
            for work in works:
                if (
                    work.request.request_id not in accepted_ids
                ):  # settled: stages/execute/speculative.py
                    commit_chunk(allocator, work.request, work.end)
            if self.config.kv_export:  # a prefill engine (stages/execute/kv_blocks.py)
                self.kv_exports += export_planned(self.kv_cache, prepared.kv_out, self.group)
            assert self.kv_cache is not None
            self.kv_cache.prefault()
        release_behind_windows(
            allocator, self._requests, prepared.step, prepared.report, self._window
        )

        result_message = step_result(
            prepared.step,
            allocator,
            request_ids=request_ids,
            token_ids=token_ids,
            logprob_request_ids=logprob_ids,
            logprobs=logprobs,
            report=prepared.report,
            num_computed_tokens=num_computed,
            forward_seconds=forward_seconds,
            prompt_logprobs=prompt_logprobs,
        )
        if self.group is not None:
            seconds = self.group.take_seconds()
            result_message = dataclasses.replace(result_message, communication_seconds=seconds)
        if embeddings:
            result_message = dataclasses.replace(result_message, embeddings=embeddings)
        if accepted_ids:
            result_message = dataclasses.replace(result_message, accepted_token_ids=accepted_ids)
        return result_message

    def run_shard(self, shard: ShardStep) -> None:
        """Run rank 0's step ``shard`` on this rank's shard of the model (a rank other than
        0): the decoder's forward pass, whose all-reduces pair with rank 0's; K/V of this
        rank's heads go to its cache. No LM head, no sampling.

        Raises:
            TensorParallelError: a collective failed or timed out.
            RuntimeError: :meth:`load` was not called, or this is rank 0.
        """
        if self.kv_cache is None or self.group is None or self.rank == 0:
            raise RuntimeError("run_shard runs on a loaded tensor-parallel rank other than 0")
        import_rank_blocks(self.kv_cache, shard, self._heads)  # a decode engine's moved blocks
        if not len(shard.token_ids):
            return  # a step that only moved blocks in
        metadata, positions = self.shard_metadata(shard)
        input_ids = torch.tensor(shard.token_ids, dtype=torch.long).to(self.device)  # [T]
        decoder = self.model.get_decoder()
        lora = shard_lora_rows(self.lora, shard)
        with torch.inference_mode(), forward_context(metadata), lora:
            decoder(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
            )
        export_rank_blocks(self.kv_cache, self.group, shard)  # a prefill engine's
        self.kv_cache.prefault()
        self.group.take_seconds()

    def shard_metadata(self, shard: ShardStep) -> tuple[Any, torch.Tensor]:
        """The attention metadata and positions of the packed batch ``shard`` over this
        runner's cache (a tensor-parallel rank's or a pipeline shard's step)."""
        assert self.kv_cache is not None
        return build_step_metadata(
            kv_cache=self.kv_cache,
            block_tables=shard.block_tables.tolist(),
            query_starts=shard.query_starts.tolist(),
            query_lens=shard.query_lens.tolist(),
            num_decode=shard.num_decode,
            decode_mode=self._decode_mode,
            flex=self._flex,
            max_model_len=self.max_model_len,
            device=self.device,
        )

    def _register(self, request: EngineRequest) -> None:
        sampling = new_sampling_state(
            request.params,
            request.prompt_token_ids,
            self._eos_token_ids,
            self.device,
            vocab_size=None if self._sampler is None else self._sampler.vocab_size,
            bad_words_token_ids=request.bad_words_token_ids,
        )
        assert self._sampler is not None
        scores = new_prompt_scores(
            request.params, request.prompt_token_ids, self._sampler.vocab_size
        )
        pooling = request.pooling
        adapter = acquire_adapter(self.lora, request, self._requests.values())
        self._requests[request.request_id] = RunnerRequest(
            request.request_id,
            sampling,
            prompt_scores=scores,
            pooling=pooling,
            prefix_cache=pooling is None or self._pooler.uses_prefix_cache(),
            lora=adapter,
            cache_key=lora_cache_key(request.lora),
        )

    def has_request(self, request_id: str) -> bool:
        """Whether the runner holds sampling state for ``request_id``."""
        return request_id in self._requests

    def output_token_ids(self, request_id: str) -> list[int]:
        """The tokens sampled so far for ``request_id`` (a copy)."""
        return list(self._requests[request_id].sampling.output_token_ids)

    def rewind(self, request_id: str, num_outputs: int, append: Sequence[int]) -> int:
        """Keep the first ``num_outputs`` outputs of ``request_id``, append ``append`` to them
        and forget the positions computed past the kept tokens, giving back the blocks they
        alone need (the draft model's roll-back, stages/execute/drafter.py; its runner
        publishes nothing to the prefix cache, so any position can be rolled back).

        Returns:
            The request's computed tokens now (its next chunk starts there).
        Raises:
            KeyError: unknown request. ValueError: ``num_outputs`` out of range.
        """
        request = self._requests[request_id]
        outputs = request.sampling.output_token_ids
        if not 0 <= num_outputs <= len(outputs):
            raise ValueError(f"{request_id!r} has {len(outputs)} outputs, not {num_outputs}")
        del outputs[num_outputs:]
        outputs.extend(append)
        kept = len(request.sampling.prompt_token_ids) + num_outputs
        if request.num_computed > kept:
            request.num_computed = kept
            assert self.allocator is not None
            self.allocator.truncate(request_id, kept)
        return request.num_computed

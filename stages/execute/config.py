"""Configuration of the execute stage's model runner."""

from __future__ import annotations

import dataclasses

from stages.pooling import POOLING_TYPES
from stages.speculative import SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_KV_CACHE_MEMORY",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "MODEL_IMPLS",
    "OMP_WAIT_POLICIES",
    "QUANTIZATIONS",
    "QUANT_ACTIVATIONS",
    "ExecuteConfig",
    "ExecuteConfigError",
    "parse_split",
]

DEFAULT_KV_CACHE_MEMORY = 384 * 1024 * 1024
"""KV cache size in bytes when neither ``num_blocks`` nor ``kv_cache_memory`` is given."""

DTYPES = ("float32", "bfloat16", "float16", "auto")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
"""``kv_cache_dtype`` values: vLLM's name and its ``auto`` (the model's dtype)."""
# vLLM's other cache dtypes (vllm/config/cache.py, CacheDType): quantized caches for GPUs.
_UNSUPPORTED_KV_CACHE_DTYPES = (
    "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "int8", "nvfp4",
)  # fmt: skip
QUANTIZATIONS = ("gguf", "int8")
QUANT_ACTIVATIONS = ("auto", "int8", "fp32")
MODEL_IMPLS = ("auto", "native", "transformers")
ATTENTION_BACKENDS = ("auto", "gather_sdpa", "flex")
#: ``omp_wait_policy`` values: pipeline.runtime.omp_policy's (not imported from there: the
#: ``pipeline`` package brings the runtime with it, and this module stays pure;
#: tests/pipeline/runtime/test_omp_policy.py checks the two agree)
OMP_WAIT_POLICIES = ("auto", "active", "passive")
_DECODE_ATTENTION_MODES = ("auto", "native", "grouped", "padded", "per_sequence")


class ExecuteConfigError(ValueError):
    """An :class:`ExecuteConfig` field is invalid; ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"ExecuteConfig.{field} {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[object, ...]:  # its __init__ is not (message,)
        return (type(self), (self.field, self.problem))


@dataclasses.dataclass(frozen=True, slots=True)
class ExecuteConfig:
    """How the execute stage loads and runs its model.

    - ``model``: an alias (``smollm2-135m``), a local HF directory or a ``.gguf`` file.
    - ``dtype``: ``float32`` (default), ``bfloat16``, ``float16`` or ``auto`` (on CPU
      ``bfloat16`` where the native bf16 GEMM builds and the CPU multiplies bf16 natively,
      AVX512-BF16 or AMX-BF16, or widens it with AVX2 and FMA, else ``float32``; on CUDA the
      checkpoint's dtype; the choice
      and its reason are logged). On CPU, ``bfloat16`` with the native linears on keeps the
      linears' and LM head's weights in bf16 and computes in fp32 (:mod:`stages.execute.bf16`).
      ``device``: ``cpu`` (default), ``cuda``, ``cuda:N`` or ``auto``.
    - KV cache: ``block_size`` tokens per block; ``num_blocks`` blocks usable by requests
      (exact; one more, the reserved padding block, is allocated), else as many as fit in
      ``kv_cache_memory`` bytes (default 384 MiB: ~8,700 tokens of SmolLM2-135M in fp32,
      and the engine process stays under 1.5 GB resident).
    - ``kv_cache_dtype``: what the KV cache stores, as vLLM's ``--kv-cache-dtype``: ``auto``
      (default: the model's dtype, so ``bfloat16`` where the weights are bf16, native bf16 on
      CPU included, whose activations are fp32), ``bfloat16`` or ``float32``. A bf16 cache
      takes half the bytes, so a ``kv_cache_memory`` budget holds twice the blocks; K/V are
      rounded to bf16 as they are written and widened to fp32 where fp32 activations attend
      (docs/architecture.md §3.1). vLLM's fp8 caches are refused.
    - ``max_model_len``: longest sequence (prompt + output); default the model's
      ``max_position_embeddings``, capped by what the cache holds.
    - ``seed``: seeds torch's global generator (requests without their own seed).
    - ``use_cuda_graphs``: capture decode batches up to ``cuda_graph_max_batch_size`` rows
      as CUDA graphs on CUDA; on CPU, the same switch runs decode steps of actorline's own
      Llama as one native call, the CPU step graph (:mod:`stages.execute.step_graph`; checked
      against the module path at load): up to ``cuda_graph_max_batch_size`` rows where the
      weights are fp32 or bf16 panels, up to 16 rows for 4/8-bit weights
      (``step_graph.plan_rows``).
    - ``decode_attention``: ``auto`` (default: ``native`` on CPU in fp32 when the kernel
      builds, else ``grouped`` on CPU and ``padded`` on CUDA), ``native`` (the compiled
      kernel of :mod:`stages.execute.native`, reading the paged cache in place), ``grouped``,
      ``padded`` or ``per_sequence`` (gather + SDPA; see
      :func:`stages.execute.attention.plan_decode_groups`).
    - ``cpu_linears``: on CPU in fp32, run linears through :mod:`stages.execute.cpu`'s
      row-count GEMM dispatch and oneDNN LM head (default on; checked against ``F.linear`` at
      load); with ``native_linears`` (default on) every linear whose output size is a
      multiple of 16 runs on the packed-weight GEMM of :mod:`stages.execute.native` instead,
      where the kernel builds. ``fused_ops``: on CPU in fp32, run each RMSNorm in one pass and
      each gated MLP's gate and up projections as one packed GEMM plus one SiLU-and-mul pass
      (:mod:`stages.execute.fused`; default on, where the kernels build; checked against the
      modules' own forwards at load). ``tune_allocator``: on CPU, raise glibc's mmap/trim
      thresholds for the process (default on).
    - ``tensor_parallel_size``: ranks the model is split over (see
      :mod:`stages.execute.tensor_parallel`); ``tensor_parallel_timeout``: seconds a
      collective may wait for the other ranks before the engine fails (a rank that hangs).
    - ``pipeline_parallel_size``: shards the decoder's layers are split over, each a process
      (see :mod:`stages.execute.pipeline_parallel`); ``pipeline_parallel_split``: their
      layer counts, comma-separated (``"10,20"``; None: even, refused where it does not
      divide); ``pipeline_parallel_timeout``: seconds the first shard waits for a step's
      sampled tokens from the last before the engine fails (a shard that hangs);
      ``pipeline_parallel_micro_batches``: steps in flight at once (None: the pipeline
      size; more than one: the shards compute at once, so each takes its share of the
      cores, :func:`~stages.execute.pp_stage.shard_threads`).
    - ``quantization``: ``None`` (default: fp32 weights), ``"gguf"`` (run a GGUF model's own
      Q8_0/Q4_0/Q4_1/Q4_K weights as they are) or ``"int8"`` (quantize any checkpoint's
      linears to int8 at load); weight-only, fp32 activations and KV, CPU fp32 only
      (:mod:`stages.execute.quant.apply`).
    - ``quant_activations``: what the quantized linears multiply their weights with:
      ``int8`` (each input row rounded to llama.cpp's Q8_0 blocks, integer dot products, as
      llama.cpp runs its 4/8-bit matrices), ``fp32`` (weight-only: exact up to fp32 rounding)
      or ``auto`` (default: ``int8`` where the quantized GEMM's int8 dot products run on byte
      multiply-adds, AVX512-VNNI, AVX-VNNI or AVX2, else ``fp32``). Only with ``quantization``
      set.
    - ``model_impl``: ``auto`` (default: actorline's own model class where it serves the
      checkpoint, :mod:`stages.execute.llama`, else transformers'), ``native`` (actorline's own,
      refused where it does not serve the checkpoint) or ``transformers`` (always
      transformers' class), as vLLM's ``--model-impl``.
    - ``attention_backend``: how attention reads the paged cache. ``gather_sdpa`` (the
      CPU native kernel or gather + SDPA, as ``decode_attention`` says), ``flex``
      (FlexAttention reading the block tables in place for decode and for prefill chunks with
      a cached prefix, :mod:`stages.execute.flex`; compiled on CUDA, eager on CPU) or
      ``auto`` (default: ``gather_sdpa`` everywhere until a GPU measurement shows flex faster,
      docs/architecture.md §6.4). ``flex`` takes ``decode_attention`` ``auto`` only.
    - ``pooling_type``: how an embedding request's final-norm hidden states become one vector
      (:data:`stages.pooling.POOLING_TYPES`: ``last`` (default), ``mean`` or ``cls``), and
      ``pooling_normalize`` whether it is L2-normalized (default on; a request may say
      otherwise), as vLLM's pooler config (docs/architecture.md §12).
    - ``omp_wait_policy``: how the OpenMP workers wait between parallel regions
      (:mod:`pipeline.runtime.omp_policy`, set in the engine process before torch loads);
      ``auto`` (default) also drops the step to one thread while the machine is
      oversubscribed and back once it is quiet (:mod:`stages.execute.contention`).
    - ``enable_lora``: serve requests with LoRA adapters (docs/lora.md): ``max_loras``
      adapters in one batch, of rank at most ``max_lora_rank``, ``max_cpu_loras`` kept loaded
      (None: ``max_loras``; adapters of running requests stay loaded). vLLM's names.
    - ``speculative_config``: with method ``draft_model`` this stage also runs the draft
      model (:meth:`draft_config`, :mod:`stages.execute.drafter`; docs/speculative.md); the
      n-gram proposer runs in the scheduler and needs nothing here.

    Raises:
        ExecuteConfigError: a field is out of range or of the wrong type.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int | None = 0
    use_cuda_graphs: bool = True
    cuda_graph_max_batch_size: int = 128
    decode_attention: str = "auto"
    cpu_linears: bool = True
    native_linears: bool = True
    fused_ops: bool = True
    tune_allocator: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 30.0
    pipeline_parallel_size: int = 1
    pipeline_parallel_split: str | None = None
    pipeline_parallel_timeout: float = 60.0
    pipeline_parallel_micro_batches: int | None = None
    quantization: str | None = None
    quant_activations: str = "auto"
    model_impl: str = "auto"
    attention_backend: str = "auto"
    pooling_type: str = "last"
    pooling_normalize: bool = True
    omp_wait_policy: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    #: a prefill engine of disaggregated prefill and decode: export each prompt's full
    #: blocks once computed (stages/execute/kv_blocks.py, docs/parallelism.md)
    kv_export: bool = False
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ExecuteConfigError("model", "must be a non-empty alias or path")
        if self.dtype not in DTYPES:
            raise ExecuteConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _valid_device(self.device):
            raise ExecuteConfigError(
                "device", f"must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}"
            )
        self._check_positive("block_size", self.block_size)
        if self.num_blocks is not None:
            self._check_positive("num_blocks", self.num_blocks)
        if self.kv_cache_memory is not None:
            self._check_positive("kv_cache_memory", self.kv_cache_memory)
        if self.kv_cache_dtype in _UNSUPPORTED_KV_CACHE_DTYPES:
            raise ExecuteConfigError(
                "kv_cache_dtype",
                f"{self.kv_cache_dtype!r} is not supported: actorline's KV cache stores "
                f"{' or '.join(KV_CACHE_DTYPES[1:])} (quantized caches are vLLM's, on GPUs)",
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ExecuteConfigError(
                "kv_cache_dtype",
                f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
            )
        if self.max_model_len is not None:
            self._check_positive("max_model_len", self.max_model_len)
        self._check_positive("cuda_graph_max_batch_size", self.cuda_graph_max_batch_size)
        self._check_positive("tensor_parallel_size", self.tensor_parallel_size)
        timeout = self.tensor_parallel_timeout
        if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):
            raise ExecuteConfigError(
                "tensor_parallel_timeout", f"must be a number of seconds > 0, got {timeout!r}"
            )
        self._check_pipeline_parallel()
        for flag in (
            "enable_prefix_caching",
            "use_cuda_graphs",
            "cpu_linears",
            "native_linears",
            "fused_ops",
            "tune_allocator",
            "pooling_normalize",
            "enable_lora",
            "kv_export",
        ):
            if type(getattr(self, flag)) is not bool:
                raise ExecuteConfigError(flag, "must be a boolean")
        if self.seed is not None and (type(self.seed) is not int or self.seed < 0):
            raise ExecuteConfigError("seed", f"must be a non-negative integer, got {self.seed!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ExecuteConfigError(
                "model_impl", f"must be one of {MODEL_IMPLS}, got {self.model_impl!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ExecuteConfigError(
                "quantization",
                f"must be None or one of {QUANTIZATIONS}, got {self.quantization!r}",
            )
        if self.quantization is not None and self.tensor_parallel_size != 1:
            raise ExecuteConfigError(
                "quantization",
                f"({self.quantization!r}) does not shard: it runs with tensor_parallel_size 1, "
                f"got {self.tensor_parallel_size}",
            )
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ExecuteConfigError(
                "quant_activations",
                f"must be one of {QUANT_ACTIVATIONS}, got {self.quant_activations!r}",
            )
        if self.quantization is None and self.quant_activations != "auto":
            raise ExecuteConfigError(
                "quant_activations",
                f"({self.quant_activations!r}) applies to quantized weights: set quantization "
                "('gguf' or 'int8') or leave it 'auto'",
            )
        if self.decode_attention not in _DECODE_ATTENTION_MODES:
            raise ExecuteConfigError(
                "decode_attention",
                f"must be one of {_DECODE_ATTENTION_MODES}, got {self.decode_attention!r}",
            )

        self._check_positive("max_loras", self.max_loras)
        self._check_positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            self._check_positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ExecuteConfigError(
                    "max_cpu_loras",
                    f"({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                    "a batch's adapters are all loaded",
                )
        if self.pooling_type not in POOLING_TYPES:
            raise ExecuteConfigError(
                "pooling_type", f"must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ExecuteConfigError(
                "attention_backend",
                f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
            )
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ExecuteConfigError(
                "omp_wait_policy",
                f"must be one of {OMP_WAIT_POLICIES}, got {self.omp_wait_policy!r}",
            )
        if self.attention_backend == "flex" and self.decode_attention != "auto":
            raise ExecuteConfigError(
                "attention_backend",
                f"'flex' attends decode rows itself; decode_attention "
                f"{self.decode_attention!r} applies to 'gather_sdpa' (leave it 'auto')",
            )

        if self.speculative_config is not None and self.speculative_config.drafts_in_execute:
            self.draft_config()

    def draft_config(self, num_blocks: int | None = None) -> ExecuteConfig:
        """How the draft model of ``speculative_config`` (method ``draft_model``) loads: its
        own model, dtype and quantization, this stage's device, block size and seed, no prefix
        caching (its drafted tokens are rolled back) and ``num_blocks`` blocks.

        Raises:
            ExecuteConfigError: (``speculative_config``) no draft model is configured, or
                its options are not valid execute options (the message says which).
        """
        spec = self.speculative_config
        if spec is None or not spec.drafts_in_execute or spec.model is None:
            raise ExecuteConfigError("speculative_config", "names no draft model")
        try:
            return dataclasses.replace(
                self,
                model=spec.model,
                dtype=spec.dtype,
                quantization=spec.quantization,
                quant_activations="auto",
                kv_cache_dtype="auto",
                num_blocks=num_blocks,
                enable_prefix_caching=False,
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                pipeline_parallel_split=None,
                enable_lora=False,
                speculative_config=None,
            )
        except ExecuteConfigError as exc:
            raise ExecuteConfigError(
                "speculative_config", f"(the draft model's) {exc.field} {exc.problem}"
            ) from None

    def _check_pipeline_parallel(self) -> None:
        self._check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        timeout = self.pipeline_parallel_timeout
        if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):
            raise ExecuteConfigError(
                "pipeline_parallel_timeout", f"must be a number of seconds > 0, got {timeout!r}"
            )
        micro_batches = self.pipeline_parallel_micro_batches
        if micro_batches is not None and (type(micro_batches) is not int or micro_batches < 1):
            raise ExecuteConfigError(
                "pipeline_parallel_micro_batches",
                f"must be None or an integer >= 1, got {micro_batches!r}",
            )
        size = self.pipeline_parallel_size
        if self.pipeline_parallel_split is not None:
            counts = parse_split(self.pipeline_parallel_split)
            assert counts is not None
            if len(counts) != size:
                raise ExecuteConfigError(
                    "pipeline_parallel_split",
                    f"names {len(counts)} shards ({self.pipeline_parallel_split}), but "
                    f"pipeline_parallel_size is {size}",
                )

    @property
    def kv_cache_bytes_budget(self) -> int:
        """The KV cache budget in bytes when ``num_blocks`` is not given."""
        return (
            self.kv_cache_memory if self.kv_cache_memory is not None else (DEFAULT_KV_CACHE_MEMORY)
        )

    @staticmethod
    def _check_positive(field: str, value: object) -> None:
        if type(value) is not int or value < 1:
            raise ExecuteConfigError(field, f"must be a positive integer, got {value!r}")


def parse_split(text: str | None, field: str = "pipeline_parallel_split") -> tuple[int, ...] | None:
    """``"10,20"`` → ``(10, 20)``; None stays None.

    Raises:
        ExecuteConfigError: not a comma-separated list of positive integers.
    """
    if text is None:
        return None
    parts = [part.strip() for part in str(text).split(",")]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ExecuteConfigError(
            field, f"must be comma-separated positive layer counts such as '10,20', got {text!r}"
        )
    return tuple(int(part) for part in parts)


def _valid_device(device: str) -> bool:
    if device in ("cpu", "cuda", "auto"):
        return True
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()

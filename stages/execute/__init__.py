"""The execute stage: model, paged KV cache, block allocator, paged attention, sampler."""

__all__: list[str] = []

"""Weight-only quantization of the execute stage's model (docs/architecture.md §6.3): the
quantized layers (``layers``), their native GEMM (``kernel``), a GGUF file's own blocks
(``gguf``), and replacing a loaded model's linears with them (``apply``)."""

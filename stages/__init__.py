"""The LLM stages: tokenize, admit, schedule, execute, detokenize, stop-check.

Importing this package is cheap; each stage lives in its own module and loads its heavy
dependencies (torch, transformers) only when used.
"""

__all__: list[str] = []

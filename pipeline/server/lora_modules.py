"""The LoRA adapters a server serves by name (docs/lora.md): ``--lora-modules`` as vLLM takes
it, ``name=path`` or a JSON object ``{"name": ..., "path": ...}``
(``vllm/entrypoints/openai/cli_args.py``, ``LoRAParserAction``), each given an id (1, 2, ...
in the order given). A request names an adapter by its ``model`` (HTTP) or ``lora_name``
(gRPC); the adapter's files are checked by the engine when a request first uses it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from stages.lora import LoRARequest, check_lora_request

__all__ = ["LoRAModules"]


class LoRAModules:
    """Adapters by name (see the module docstring)."""

    def __init__(self, adapters: Mapping[str, LoRARequest] | None = None) -> None:
        self.adapters: dict[str, LoRARequest] = dict(adapters or {})

    @classmethod
    def parse(cls, values: Iterable[str]) -> LoRAModules:
        """The adapters of ``--lora-modules`` values.

        Raises:
            ValueError: a value that is neither ``name=path`` nor a JSON object with a
                ``name`` and a ``path``, an empty name or path, or a name given twice.
        """
        adapters: dict[str, LoRARequest] = {}
        for value in values:
            name, path = _name_and_path(value)
            if name in adapters:
                raise ValueError(f"--lora-modules: adapter {name!r} is given twice")
            lora = LoRARequest(name, len(adapters) + 1, path)
            try:
                check_lora_request(lora)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {value!r:.200}: {exc}") from None
            adapters[name] = lora
        return cls(adapters)

    def __bool__(self) -> bool:
        return bool(self.adapters)

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter named ``name`` (None: no such adapter)."""
        return self.adapters.get(name) if name is not None else None


def _name_and_path(value: str) -> tuple[str, str]:
    text = value.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {value!r:.200}: not JSON ({exc})") from None
        if (
            not isinstance(entry, dict)
            or set(entry) != {"name", "path"}
            or not all(isinstance(entry[key], str) for key in ("name", "path"))
        ):
            raise ValueError(
                f"--lora-modules {value!r:.200}: a JSON entry has a string name and path, "
                "nothing else"
            )
        return entry["name"], entry["path"]
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"--lora-modules {value!r:.200}: expected name=path or a JSON object")
    return name, path

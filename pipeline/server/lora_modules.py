"""The LoRA adapters a server serves by name (docs/lora.md): ``--lora-modules`` as vLLM takes
it, ``name=path`` or a JSON object ``{"name": ..., "path": ...}``
(``vllm/entrypoints/openai/cli_args.py``, ``LoRAParserAction``), each given an id (1, 2, ...
in the order given). A request names an adapter by its ``model`` (HTTP) or ``lora_name``
(gRPC); the adapter's files are checked by the engine when a request first uses it.

With runtime updates (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
:mod:`pipeline.server.http.lora_updates`) adapters are added and removed while the server
runs: each added one gets a new id, never one an adapter had before (an id is one adapter in
the engine, which may still hold the weights of a removed one), as vLLM's counter gives."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping

from pipeline.server.auth import PermissionDeniedError
from stages.lora import LoRARequest, check_lora_request

__all__ = ["LoRAModules"]


class LoRAModules:
    """Adapters by name (see the module docstring)."""

    def __init__(self, adapters: Mapping[str, LoRARequest] | None = None) -> None:
        self.adapters: dict[str, LoRARequest] = dict(adapters or {})
        self._last_id = max((lora.lora_int_id for lora in self.adapters.values()), default=0)

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

    def bound(
        self, adapter: str, requested: str | None, base_names: Collection[str], field: str
    ) -> LoRARequest | None:
        """The adapter a request of a key bound to ``adapter`` runs with, whatever model it
        names of ``requested`` (None, one of the base model's ``base_names``, or ``adapter``
        itself): ``adapter``'s; None when it is not served now (removed at run time).

        Raises:
            PermissionDeniedError: ``requested`` is another adapter or model (``field``).
        """
        if requested and requested != adapter and requested not in base_names:
            raise PermissionDeniedError(
                f"this API key is bound to the LoRA adapter {adapter!r:.80}; it cannot use "
                f"the model {requested!r:.80}",
                field=field,
            )
        return self.adapters.get(adapter)

    def check_bindings(
        self, bound: Iterable[str], enable_lora: bool, runtime_updates: bool
    ) -> None:
        """Check, at start, the adapters API keys are bound to (``bound``): LoRA must be on,
        and each must be served, unless runtime updates may load it later.

        Raises:
            ValueError: naming the first that is not.
        """
        for name in bound:
            if not enable_lora:
                raise ValueError(
                    f"an API key is bound to the LoRA adapter {name!r}: give --enable-lora"
                )
            if name not in self.adapters and not runtime_updates:
                raise ValueError(
                    f"an API key is bound to the LoRA adapter {name!r}, which --lora-modules "
                    "does not serve"
                )

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``, under a new id (its files are the
        caller's to check): :meth:`reserve` then :meth:`serve`.

        Raises:
            ValueError: ``name`` is served already, or a field is unusable (named).
        """
        return self.serve(self.reserve(name, path))

    def reserve(self, name: str, path: str) -> LoRARequest:
        """The adapter at ``path`` named ``name`` under a new id, not served yet (the caller
        checks its files, then passes it to :meth:`serve`; an id reserved is never given
        again).

        Raises:
            ValueError: ``name`` is served already, or a field is unusable (named).
        """
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora = check_lora_request(LoRARequest(name, self._last_id + 1, path))
        self._last_id += 1
        return lora

    def serve(self, lora: LoRARequest) -> LoRARequest:
        """Serve ``lora`` (from :meth:`reserve`) by its name; returns it.

        Raises:
            ValueError: its name was served meanwhile.
        """
        if lora.lora_name in self.adapters:
            raise ValueError(f"The lora adapter '{lora.lora_name}' has already been loaded.")
        self.adapters[lora.lora_name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving the adapter ``name``; returns it (None: no such adapter)."""
        return self.adapters.pop(name, None)


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

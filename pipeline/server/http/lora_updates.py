"""vLLM's runtime LoRA endpoints (docs/lora.md, "Loading and unloading at run time"):
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (or ``{"lora_int_id"}``), served only with
``enable_lora_runtime_updates`` (vLLM serves them only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; elsewhere they are 404s). Shapes, status codes and
messages are vLLM's (``vllm/entrypoints/openai/serving_models.py``,
``OpenAIServingModels.load_lora_adapter`` / ``unload_lora_adapter``): 200 with a plain-text
``Success: ...`` line; 400 for a missing field or a name loaded already; 404 for an unknown
name on unload.

A load checks the adapter's files against the engine's model before it is served (the
engine's check, :func:`~stages.lora.read_adapter`, off the event loop: config, rank against
``max_lora_rank``, every tensor's name, dtype and shape): a bad adapter is a 400 naming it
and the problem, and nothing of it is served. Its weights load when a request first uses
it, on the execute stage's loader thread, beside the running streams. An unload stops
serving the name at once; requests already running with it finish with it (as vLLM's), and
the engine drops its weights past ``max_cpu_loras`` once none uses it.

Both sit under ``/v1/``, so they need an API key where the server has keys; a key bound to
an adapter may not change the server's adapters (403).
"""

from __future__ import annotations

import functools
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from pipeline.server.http.errors import ApiError
from pipeline.server.http.gate import tenant_of
from pipeline.server.http.state import HttpService
from stages.errors import RequestError

__all__ = ["LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "add_lora_update_routes"]

logger = logging.getLogger("actorline.server.http")

_STRICT = ConfigDict(extra="forbid", strict=True)
#: the prompt a load's check of the adapter goes with (the check is the adapter's)
_CHECK_PROMPT = {"prompt_token_ids": [0]}


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/load_lora_adapter``."""

    model_config = _STRICT
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/unload_lora_adapter``."""

    model_config = _STRICT
    lora_name: str | None = None
    lora_int_id: int | None = None


def _check_unbound(service: HttpService, request: Request) -> None:
    bound = service.tenant_adapters.get(tenant_of(request.scope))
    if bound is not None:
        raise ApiError(
            403,
            f"this API key is bound to the LoRA adapter {bound!r:.80}; it may not load or "
            "unload adapters",
            code="permission_denied",
        )


def _text(message: str) -> Response:
    return Response(message, media_type="text/plain; charset=utf-8")


async def load_lora_adapter(service: HttpService, body: LoadLoRAAdapterRequest) -> Response:
    """Serve the adapter at ``body.lora_path`` as ``body.lora_name`` (see the module
    docstring).

    Raises:
        ApiError: 400 for a missing field, a name served already (the base model's too) or
            an adapter that cannot be served (named); 503 while the engine cannot serve.
    """
    problem = service.problem()
    if problem is not None:
        raise problem
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if name in (service.model_name, service.engine.options.model):
        raise ApiError(
            400,
            f"'{name:.80}' is the base model's name; give the adapter another",
            param="lora_name",
        )
    if service.lora_modules.get(name) is not None:
        raise ApiError(400, f"The lora adapter '{name:.80}' has already been loaded.")
    try:
        lora = service.lora_modules.reserve(name, path)
        # NOTE: the engine's own check of the adapter (stages.lora.read_adapter: it reads
        # the config and hashes the weights file), off the event loop; it is cached, so the
        # adapter's first request does not read the files again on the loop
        await run_in_threadpool(
            functools.partial(service.engine.check, _CHECK_PROMPT, lora_request=lora)
        )
        service.lora_modules.serve(lora)
    except RequestError as exc:
        raise ApiError.from_error(exc) from None
    except ValueError as exc:  # loaded meanwhile by another call, or a field out of range
        raise ApiError(400, str(exc)) from None
    logger.info("loaded LoRA adapter %r (id %d) from %r", name, lora.lora_int_id, path)
    return _text(f"Success: LoRA adapter '{name}' added successfully.")


def unload_lora_adapter(service: HttpService, body: UnloadLoRAAdapterRequest) -> Response:
    """Stop serving the adapter ``body.lora_name`` (or of id ``body.lora_int_id``).

    Raises:
        ApiError: 400 when neither is given; 404 for an adapter not served.
    """
    name = body.lora_name
    if not name and body.lora_int_id is None:
        raise ApiError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.")
    if not name:
        found = [
            served
            for served, lora in service.lora_modules.adapters.items()
            if lora.lora_int_id == body.lora_int_id
        ]
        name = found[0] if found else str(body.lora_int_id)
    if service.lora_modules.remove(name) is None:
        raise ApiError(
            404, f"The lora adapter '{name:.80}' cannot be found.", code="model_not_found"
        )
    logger.info("unloaded LoRA adapter %r", name)
    return _text(f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_update_routes(app: FastAPI, service: HttpService) -> None:
    """Serve the two endpoints on ``app`` (the caller decides whether: the option)."""
    logger.warning(
        "LoRA adapters may be loaded and unloaded at run time (/v1/load_lora_adapter): they "
        "read any path the server can; keep these endpoints to trusted keys"
    )

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        _check_unbound(service, request)
        return await load_lora_adapter(service, body)

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        _check_unbound(service, request)
        return unload_lora_adapter(service, body)

"""The wire tags: the one table of every message class actorline registers with the codec.

A message travels as its tag and its fields (docs/architecture.md §5.4); both ends map the
tag back to the class, so a tag must name one class everywhere. The table lives here, in the
lowest layer that registers messages, so every registering module can read it: a module
declares ``@message()`` (no tag) and :func:`transports.codec.message` takes the class's tag
from :data:`WIRE_TAGS` by its qualified name. Adding a message is one line here;
``tests/transports/test_tags.py`` fails if two classes share a tag, if a registered class of
ours is missing from the table, or if a module still numbers its own tags.

Ranges: 1-19 transports, 20-49 the runtime's control protocol, 50-59 free, 60-69 the Collatz
demo, 100-199 and 200-249 the LLM stages, 900-949 the transports' conformance kit. Tests
register their own messages with explicit tags in 60-99 (past the demo's) or 950-999.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["WIRE_TAGS", "tag_of"]

#: qualified class name (``module.Class``) -> tag
WIRE_TAGS: Mapping[str, int] = MappingProxyType(
    {
        # transports
        "transports.base.LinkStatistics": 10,
        # pipeline.runtime: statistics and the control protocol (pipeline/runtime/control.py)
        "pipeline.runtime.control.StageStatistics": 20,
        "pipeline.runtime.control.HostStatistics": 21,
        "pipeline.runtime.control.BindLinks": 30,
        "pipeline.runtime.control.LinksBound": 31,
        "pipeline.runtime.control.ConnectLinks": 32,
        "pipeline.runtime.control.StartStages": 33,
        "pipeline.runtime.control.QueryStatistics": 34,
        "pipeline.runtime.control.StopHost": 35,
        "pipeline.runtime.control.Ack": 36,
        "pipeline.runtime.control.HostFailure": 37,
        "pipeline.runtime.replicas.ReplicaLost": 38,
        "pipeline.runtime.control.CutReplica": 39,
        "pipeline.runtime.control.LinkLost": 40,
        "pipeline.runtime.control.TellRestored": 41,
        # the Collatz demo (pipeline/demo.py)
        "pipeline.demo.Job": 60,
        "pipeline.demo.Item": 61,
        "pipeline.demo.JobResult": 62,
        "pipeline.demo.Credit": 63,
        # the LLM stages
        "stages.params.SamplingParams": 100,
        "stages.messages.ChatMessage": 101,
        "stages.messages.GenerateRequest": 102,
        "stages.messages.EngineRequest": 103,
        "stages.messages.RequestRejected": 104,
        "stages.messages.AbortRequests": 105,
        "stages.messages.EngineInfo": 106,
        "stages.messages.ScheduledChunk": 107,
        "stages.messages.SchedulerStep": 108,
        "stages.messages.Logprobs": 109,
        "stages.messages.StepResult": 110,
        "stages.messages.EngineStats": 111,
        "stages.messages.EngineOutputs": 112,
        "stages.messages.TextOutputs": 113,
        "stages.messages.RequestOutput": 114,
        "stages.messages.RequestOutputs": 115,
        "stages.messages.RequestMetrics": 116,
        "stages.messages.ToolCall": 117,
        "stages.messages.ToolSpec": 118,
        "stages.messages.OutputParsing": 119,
        "stages.structured.params.StructuredOutputsParams": 120,
        "stages.messages.ChatRendering": 127,
        "stages.pooling.PoolingParams": 121,
        "stages.lora.LoRARequest": 135,
        "stages.execute.rank_messages.Rendezvous": 140,
        "stages.execute.rank_messages.ShardStep": 141,
        "stages.execute.pp_messages.PipelineStep": 142,
        # the last pipeline shard samples (stages/execute/pp_sampling.py)
        "stages.execute.pp_messages.PipelineSampled": 196,
        "stages.execute.pp_messages.PipelineSampling": 197,
        "stages.execute.pp_messages.PipelineRequest": 198,
        # the draft model placed apart (stages/execute/draft_messages.py)
        "stages.execute.draft_messages.DraftQuery": 181,
        "stages.execute.draft_messages.DraftFeed": 182,
        "stages.execute.draft_messages.DraftProposals": 183,
        "stages.execute.draft_messages.DraftReady": 184,
        # disaggregated prefill and decode (stages/kv_transfer.py)
        "stages.kv_transfer.KvBlocks": 163,
        "stages.kv_transfer.KvArrived": 200,
        "stages.kv_transfer.KvRelease": 201,
        # the conformance kit's samples (transports/_kit_samples.py)
        "transports._kit_samples.KitPing": 900,
        "transports._kit_samples.KitPayload": 901,
        "transports._kit_samples.KitArrays": 902,
        "transports._kit_samples.KitEnvelope": 903,
    }
)


def tag_of(cls: type) -> int:
    """The tag of ``cls`` in :data:`WIRE_TAGS`.

    Raises:
        LookupError: ``cls`` is not in the table (add a line to ``transports/tags.py``).
    """
    name = f"{cls.__module__}.{cls.__qualname__}"
    try:
        return WIRE_TAGS[name]
    except KeyError:
        raise LookupError(
            f"{name} has no wire tag: add it to WIRE_TAGS in transports/tags.py"
        ) from None

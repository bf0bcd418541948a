"""Adapter affinity (docs/lora.md, stages/router.py): the least-loaded policy prefers the
least loaded replica that has a request's LoRA adapter loaded, under the balance guard;
prefix affinity never crosses adapters; the router stage's books of what each replica keeps
loaded (pure logic, then the stage's bookkeeping)."""

from __future__ import annotations

from stages.route import ReplicaRoute, RouterConfig, RouterStage
from stages.router import LeastLoadedPolicy, ReplicaLoad, RouteRequest, block_hashes


def request(tokens: list[int], adapter: str = "") -> RouteRequest:
    return RouteRequest("r", "", len(tokens), block_hashes(tokens, 4, 3, adapter), adapter)


def load(name: str, tokens: int, *adapters: str) -> ReplicaLoad:
    return ReplicaLoad(name, tokens, tokens // 10, frozenset(adapters))


def test_a_request_goes_to_the_least_loaded_replica_holding_its_adapter() -> None:
    policy = LeastLoadedPolicy(balance_ratio=2.0, balance_tokens=100)
    replicas = [load("a", 0), load("b", 120, "sql"), load("c", 60, "sql", "chat")]
    assert policy.choose(request([1], "sql"), replicas) == "c"
    assert policy.choose(request([1], "chat"), replicas) == "c"
    assert policy.adapter_hits == 2
    # no replica has it, or the base model: the least loaded
    assert policy.choose(request([1], "math"), replicas) == "a"
    assert policy.choose(request([1]), replicas) == "a"
    assert policy.adapter_hits == 2


def test_adapter_affinity_yields_to_a_large_imbalance() -> None:
    policy = LeastLoadedPolicy(balance_ratio=2.0, balance_tokens=100)
    assert policy.choose(request([1], "sql"), [load("a", 10), load("b", 120, "sql")]) == "b"
    assert policy.choose(request([1], "sql"), [load("a", 10), load("b", 121, "sql")]) == "a"


def test_prefix_hashes_are_keyed_by_adapter() -> None:
    tokens = [7] * 12
    assert block_hashes(tokens, 4, 3) != block_hashes(tokens, 4, 3, "sql")
    assert block_hashes(tokens, 4, 3, "sql") != block_hashes(tokens, 4, 3, "chat")
    assert block_hashes(tokens, 4, 3, "sql") == block_hashes(tokens, 4, 3, "sql")
    policy = LeastLoadedPolicy()
    replicas = [load("a", 0), load("b", 0)]
    assert policy.choose(request(tokens, "sql"), [load("a", 10), load("b", 0)]) == "b"
    # the same prompt under another adapter or the base model: no prefix of b's applies
    assert policy.choose(request(tokens, "chat"), [load("a", 0), load("b", 5)]) == "a"
    assert policy.choose(request(tokens), replicas) == "a"
    assert policy.affinity_hits == 0
    assert policy.choose(request(tokens, "sql"), [load("a", 0), load("b", 50)]) == "b"
    assert policy.affinity_hits == 1


def test_the_router_stage_keeps_what_each_replica_has_loaded() -> None:
    routes = (ReplicaRoute("0", "admit", "schedule"), ReplicaRoute("1", "admit1", "schedule1"))
    router = RouterStage(RouterConfig(routes, max_loras=1, max_cpu_loras=2))
    for adapter in ("sql", "chat", "sql", "math"):
        router.record_adapter("0", adapter)
    assert router.load("0").adapters == frozenset({"sql", "math"})  # chat: least recent
    assert router.load("1") == ReplicaLoad("1", 0, 0)

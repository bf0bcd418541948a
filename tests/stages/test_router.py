"""The routing policies (pure): least-loaded with prefix affinity and its balance guard,
round-robin, block hashes, and loading them as plugins."""

from __future__ import annotations

import pytest

import plugins
from stages.router import (
    LeastLoadedPolicy,
    ReplicaLoad,
    RoundRobinPolicy,
    RouterConstructionError,
    RouteRequest,
    block_hashes,
    load_router,
)


def request(tokens: list[int], request_id: str = "r") -> RouteRequest:
    return RouteRequest(request_id, "", len(tokens), block_hashes(tokens, 4, 3))


def loads(**outstanding: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, tokens, tokens // 10) for name, tokens in outstanding.items()]


def test_block_hashes_are_chained_over_full_blocks_only() -> None:
    assert block_hashes([1, 2, 3], 4, 3) == ()
    first = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 3)
    assert len(first) == 2  # the ninth token is not a full block
    assert block_hashes([1, 2, 3, 4, 0, 0, 0, 0], 4, 3)[0] == first[0]
    assert block_hashes([1, 2, 3, 4, 0, 0, 0, 0], 4, 3)[1] != first[1]
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, 3)[1] != first[1]  # chained
    assert len(block_hashes(list(range(100)), 4, 3)) == 3


def test_least_loaded_picks_the_fewest_outstanding_tokens() -> None:
    policy = LeastLoadedPolicy()
    assert policy.choose(request([1]), loads(a=100, b=20, c=50)) == "b"
    assert policy.choose(request([1]), loads(a=5, b=5)) == "a"  # ties: by name


def test_prefix_affinity_follows_the_longest_shared_prefix() -> None:
    policy = LeastLoadedPolicy()
    shared = [7] * 8
    assert policy.choose(request([*shared, 1, 2, 3, 4]), loads(a=0, b=10)) == "a"
    assert policy.choose(request([5] * 12), loads(a=10, b=0)) == "b"
    # a's prefix wins over b being less loaded, and is remembered for the longer prefix too
    assert policy.choose(request([*shared, 9, 9, 9, 9]), loads(a=300, b=0)) == "a"
    assert policy.affinity_hits == 1
    # the deeper match decides: the first block is a's, the first two b's
    assert policy.choose(request([5] * 8 + [1] * 4), loads(a=0, b=200)) == "b"


def test_affinity_yields_to_a_large_imbalance() -> None:
    policy = LeastLoadedPolicy(balance_ratio=2.0, balance_tokens=100)
    shared = [3] * 8
    assert policy.choose(request(shared), loads(a=0, b=1)) == "a"
    assert policy.choose(request(shared), loads(a=150, b=30)) == "a"  # 150 <= 2*30+100
    assert policy.choose(request(shared), loads(a=170, b=30)) == "b"  # 170 > 160
    # the prefix now belongs to b
    assert policy.choose(request(shared), loads(a=0, b=50)) == "b"


def test_a_forgotten_replica_loses_its_prefixes() -> None:
    policy = LeastLoadedPolicy()
    policy.choose(request([4] * 8), loads(a=0, b=1))
    policy.forget_replica("a")
    assert policy.choose(request([4] * 8), loads(a=50, b=0)) == "b"
    assert policy.affinity_hits == 0


def test_affinity_memory_is_bounded() -> None:
    policy = LeastLoadedPolicy(capacity=2)
    for token in range(5):
        policy.choose(request([token] * 4), loads(a=0))
    assert policy.remembered == 2


def test_round_robin_takes_turns_over_live_replicas() -> None:
    policy = RoundRobinPolicy()
    picks = [policy.choose(request([1]), loads(a=0, b=0, c=0)) for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]


def test_routers_are_plugins() -> None:
    assert {"least-loaded", "round-robin"} <= set(plugins.available(plugins.ROUTERS))
    assert isinstance(load_router("least-loaded"), LeastLoadedPolicy)
    with pytest.raises(plugins.PluginNotFoundError, match="least-loaded"):
        load_router("carrier-pigeon")


def test_invalid_balance_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        LeastLoadedPolicy(balance_ratio=0.5)
    assert issubclass(RouterConstructionError, plugins.PluginError)

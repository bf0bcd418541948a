"""The OpenMP wait policy of an engine process (pipeline.runtime.omp_policy): what each policy
sets, that a user's variable wins, and, in fresh processes, that the runtime torch loads
afterwards follows it (a passive or ``auto`` worker sleeps between regions, where the
runtime's default on this kind of CPU spins through ~10 ms)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.omp_policy import (
    AUTO_SPIN_COUNT,
    OMP_WAIT_POLICIES,
    POLICY_ENV,
    apply_omp_policy,
    omp_environment,
    openmp_loaded,
    wait_policy_in_effect,
)
from pipeline.runtime.settings import child_environment

ROOT = Path(__file__).resolve().parents[3]


def test_the_execute_config_takes_the_same_policies() -> None:
    from stages.execute.config import OMP_WAIT_POLICIES as EXECUTE_POLICIES

    assert EXECUTE_POLICIES == OMP_WAIT_POLICIES


def test_each_policy_sets_its_variables() -> None:
    assert omp_environment("auto", {}) == {"GOMP_SPINCOUNT": str(AUTO_SPIN_COUNT)}
    assert omp_environment("active", {}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert omp_environment("passive", {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert set(OMP_WAIT_POLICIES) == {"auto", "active", "passive"}


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "0"}])
@pytest.mark.parametrize("policy", OMP_WAIT_POLICIES)
def test_a_variable_the_user_set_wins(policy: str, user: dict[str, str]) -> None:
    environ = dict(user)
    assert omp_environment(policy, environ) == {}
    assert apply_omp_policy(policy, environ)
    assert environ == {**user, POLICY_ENV: policy}
    assert wait_policy_in_effect(environ).startswith("user (")


def test_apply_reads_the_parents_choice_and_says_what_is_in_effect() -> None:
    environ = {POLICY_ENV: "passive"}
    assert apply_omp_policy(None, environ)
    assert environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert wait_policy_in_effect(environ) == "passive (OMP_WAIT_POLICY=PASSIVE)"
    fresh: dict[str, str] = {}
    assert apply_omp_policy(None, fresh)
    assert wait_policy_in_effect(fresh) == f"auto (GOMP_SPINCOUNT={AUTO_SPIN_COUNT})"
    assert wait_policy_in_effect({}) == "runtime default"


def test_a_bad_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"omp_wait_policy must be one of .* got 'spin'"):
        apply_omp_policy("spin", {})
    with pytest.raises(ValueError, match="got 'lazy'"):
        apply_omp_policy(None, {POLICY_ENV: "lazy"})


def test_too_late_once_the_runtime_is_loaded() -> None:
    import torch  # noqa: F401  # loads libgomp in this process

    assert openmp_loaded() is True
    # os.environ (the default) is left alone: the loaded runtime would not read it
    assert apply_omp_policy("passive") is False


_PROBE = """
import json, sys, time
from pipeline.runtime.omp_policy import apply_omp_policy, wait_policy_in_effect
if sys.argv[1] != "none":
    apply_omp_policy(sys.argv[1])
import torch
torch.set_num_threads(2)
x = torch.randn(256, 256)
best = None
for _ in range(5):
    (x @ x).sum()  # a parallel region: the second worker exists now
    start = time.process_time()
    time.sleep(0.2)
    idle = time.process_time() - start
    best = idle if best is None else min(best, idle)
print(json.dumps({"idle_cpu": best, "in_effect": wait_policy_in_effect()}))
"""


def _probe(policy: str) -> dict[str, object]:
    environment = child_environment(
        {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None,
         POLICY_ENV: None, "OMP_NUM_THREADS": None}
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, policy],
        capture_output=True, text=True, env=environment, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


@pytest.mark.parametrize("policy", ["passive", "auto"])
def test_the_workers_sleep_between_regions(policy: str) -> None:
    """The process's CPU time over 0.2 s of sleep after a parallel region (least of 5): the
    worker's spin, if any. Passive sleeps at once, ``auto`` after ~0.5 ms of spinning; an
    upper bound only (a loaded machine can only make a spinner look smaller)."""
    result = _probe(policy)
    assert result["in_effect"].startswith(policy)  # type: ignore[union-attr]
    assert result["idle_cpu"] < 0.05, result  # type: ignore[operator]

"""The whole step's balance-independent terms are the same for every planner on the same workload and layout.

Every planner config of experiments/conf/planner that routes by the trace is composed as the entry point
composes it and simulated on one random workload; wherever a planner's plans keep the layout's samples on
their GPUs (all but the locality round, which may move a few), its head, router, norm, host-overhead and
optimizer columns equal Megatron-LM's, bit for bit. The exposed part of the gradient reduce-scatter and
parameter all-gather is left out: it depends on how long the last (first) micro-batch takes, which a plan
changes (the full collectives are per-cluster constants of the cost model).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra.cluster import ClusterSpec
from relibra.cost.model import CostModel
from relibra.simulator import SimOptions, simulate
from relibra.types import BatchPlan, SampleCounts, Workload
from relibra.workload import build_workload
from tests.builders import HOPPER, planner_config, random_counts, tiny_model, training_spec

CONF = Path(__file__).resolve().parents[1] / "experiments" / "conf"
PLANNERS = sorted(
    p.stem
    for p in (CONF / "planner").glob("*.yaml")
    if p.stem not in ("balanced", "force_balanced", "relibra_milp")
)
"""Balanced is an ideal (mean tokens, no plan), force-balanced routes another workload, and the MILP is
slow; every other planner."""
INDEPENDENT = ("t_head_s", "t_router_s", "t_norm_s", "t_launch_s", "t_optimizer_s")


FAST = ("megatron", "eplb", "lplb", "ultraep", "llep", "relibra_replicate_only")


def _per_gpu_tokens(plans: tuple[BatchPlan, ...], counts: SampleCounts, work: Workload) -> list[np.ndarray]:
    """Per batch, the sorted tokens each GPU holds in each micro-batch [Mb, G] (GPU names do not matter)."""
    out = []
    for b, plan in enumerate(plans):
        sl = counts.batch(b)
        mb = work.sample_mb[sl] - int(work.batch_microbatches(b)[0])
        held = np.zeros((int(mb.max()) + 1, work.tokens.shape[1]))
        np.add.at(held, (mb, plan.sample_gpu), counts.tokens[sl])
        out.append(np.sort(held, axis=1))
    return out


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from([(1, 4), (2, 2)]),
    skew=st.floats(0.0, 2.5),
    dispatcher=st.sampled_from(["alltoall", "deepep"]),
    recompute=st.sampled_from(["none", "selective", "full"]),
)
def test_balance_independent_terms_do_not_depend_on_the_planner(
    seed: int, shape: tuple[int, int], skew: float, dispatcher: str, recompute: str
) -> None:
    check_planners(PLANNERS, seed, shape, skew, dispatcher, recompute)


def test_balance_independent_terms_of_the_fast_planners() -> None:
    """The fast companion: one skewed two-node workload, the planners that keep the layout."""
    assert check_planners(FAST, 3, (2, 2), 2.0, "alltoall", "full") == len(FAST)


def check_planners(
    names: tuple[str, ...] | list[str],
    seed: int,
    shape: tuple[int, int],
    skew: float,
    dispatcher: str,
    recompute: str,
) -> int:
    """Simulate every planner of ``names`` and Megatron-LM on one workload; returns how many were compared."""
    from hydra.utils import instantiate

    nodes, gpn = shape
    g = nodes * gpn
    model = tiny_model(num_experts=2 * g)
    counts = random_counts(num_samples=4 * g, num_experts=model.num_experts, seed=seed, skew=skew)
    work = build_workload(counts, g, samples_per_microbatch=2)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpn, hardware=HOPPER, dispatcher=dispatcher)
    cost = CostModel(cluster, model, training=training_spec(recompute=recompute))
    options = SimOptions(keep_plans=True)
    ref = simulate(
        instantiate(planner_config("megatron"), _convert_="all"), counts, work, cluster, model, cost, options
    )
    assert all(ref.metrics[k] > 0 for k in ("t_head_s", "t_router_s", "t_norm_s", "t_optimizer_s"))
    layout = _per_gpu_tokens(ref.plans, counts, work)
    compared = 0
    for name in names:
        res = simulate(
            instantiate(planner_config(name), _convert_="all"), counts, work, cluster, model, cost, options
        )
        mine = _per_gpu_tokens(res.plans, counts, work)
        if any(not np.array_equal(a, b) for a, b in zip(mine, layout, strict=True)):
            continue  # the locality round moved samples: another layout
        compared += 1
        for key in INDEPENDENT:
            assert res.metrics[key] == ref.metrics[key], (name, key, res.metrics[key], ref.metrics[key])
    assert compared >= min(len(names), 6)  # the locality-round configurations may move samples
    return compared

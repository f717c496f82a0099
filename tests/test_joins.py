"""The pricing join: :func:`relibra.cost.pricing.predict_batch_time` is the batch time :func:`simulate`
reports.

A planner that compares candidate plans (the portfolio) prices them with ``predict_batch_time``; the
results table reports what ``simulate`` charged. Both must be the same number for every kind of plan:
static placements, reordering with migration, replica slots refilled behind attention, permanent redundant
slots (EPLB+, LPLB+), online plans with critical-path time and fabric copies (UltraEP, LLEP), under both
dispatchers and with the all-to-all overlapped (``cluster.ep_overlap``), on the whole step (the default:
every term of relibra/cost/step.py, with activation recompute, FP8 and the RL step's forward-only passes
in some cells), under pipeline and tensor parallelism (``parallel.pp``, ``parallel.tp``) and on the MoE-only
step (``simulator.step=moe``). The cells are built from the
planner configs as ``python -m experiments.run`` builds them (control plane included); each batch's plan
is re-priced on the context ``simulate`` gave it (same previous placement) and compared bitwise.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from experiments.config.build import (
    build_cluster,
    build_cost,
    build_model,
    build_planner,
    build_workload_for,
    load_counts,
    planning,
    sim_options,
)
from experiments.config.presets import CONF_DIR
from experiments.config.spec import build_spec
from relibra.cost.pricing import predict_batch_time
from relibra.simulator import WHOLE_STEP_COLUMNS, batch_context, simulate

CELL = [
    "model=olmoe-1b-7b",
    "trace.preset=mixed",
    "cluster.nodes=2",
    "cluster.gpus_per_node=4",
    "trace.num_batches=2",
    "trace.samples_per_batch=32",
    "trace.max_tokens=256",
    "logger=none",
]
"""OLMoE (16 layers, 64 experts) on 2 nodes of 4 GPUs, 2 batches of 32 short rollouts: every stage runs."""
CLUSTERS = {
    "alltoall": [],
    "deepep": ["cluster.dispatcher=deepep"],
    "ep_overlap": ["cluster.ep_overlap=true"],
    "deepep_overlap": ["cluster.dispatcher=deepep", "cluster.ep_overlap=true", "cluster.comm_sms=32"],
    "moe_step": ["simulator.step=moe"],
    "rl_passes": ["workload.rl_passes=[reference,recompute,update]", "training.recompute=selective"],
    "fp8_full": ["cluster.precision=fp8", "training.recompute=full", "cluster.ep_overlap=true"],
    "pipeline": ["parallel.pp=2", "parallel.vpp=2", "workload.rl_passes=[recompute,update]"],
    "tensor": ["parallel.tp=2", "training.recompute=full", "cluster.ep_overlap=true"],
}
PLANNERS = (
    "megatron",
    "eplb",
    "lplb",
    "popfetcher",
    "ultraep",
    "llep",
    "relibra",
    "relibra_replicate_only",
    "relibra_reorder_only",
    "relibra_portfolio",
)
"""Every kind of plan: static, redundant slots, prefetch buffer, online (two), ReLibra and its ablations,
the portfolio. Balanced is a bound (no plan to price)."""
DEFAULT = {
    ("megatron", "alltoall"),
    ("eplb", "ep_overlap"),
    ("ultraep", "deepep"),
    ("llep", "alltoall"),
    ("relibra", "deepep"),
    ("relibra_replicate_only", "ep_overlap"),
    ("relibra", "deepep_overlap"),
    ("relibra_replicate_only", "deepep_overlap"),
    ("eplb", "moe_step"),
    ("relibra", "rl_passes"),
    ("ultraep", "rl_passes"),
    ("llep", "fp8_full"),
    ("relibra", "pipeline"),
    ("megatron", "pipeline"),
    ("relibra_portfolio", "tensor"),
    ("ultraep", "tensor"),
}
"""The cells of the default run (each kind of cost term once); the rest of the grid is marked slow."""
TERMS = {
    "eplb": "redundant_slot_bytes",
    "lplb": "redundant_slot_bytes",
    "ultraep": "t_critical_path_s",
    "llep": "t_critical_path_s",
    "relibra": "t_reorder_s",
    "relibra_reorder_only": "t_reorder_s",
}
"""The cost term a planner's plans must exercise in the cell (else the cell would not test its pricing)."""


def _grid() -> list:
    return [
        pytest.param(p, c, marks=() if (p, c) in DEFAULT else pytest.mark.slow, id=f"{p}-{c}")
        for p, c in itertools.product(PLANNERS, CLUSTERS)
    ]


@pytest.mark.parametrize(("planner_name", "cluster_name"), _grid())
def test_prediction_is_the_simulated_batch_time(planner_name: str, cluster_name: str) -> None:
    overrides = [*CELL, *CLUSTERS[cluster_name], f"planner={planner_name}"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="joins"):
        cfg = compose("config", overrides=overrides)
    cluster, model = build_cluster(build_spec(cfg)), build_model(build_spec(cfg))
    cost = build_cost(build_spec(cfg), cluster, model)
    counts, workload = build_workload_for(build_spec(cfg), load_counts(build_spec(cfg)), cluster.num_gpus)
    options = sim_options(build_spec(cfg), keep_plans=True)
    with planning(build_spec(cfg), build_planner(build_spec(cfg)), cluster, model, cost) as planner:
        sim = simulate(planner, counts, workload, cluster, model, cost, options)
    assert len(sim.plans) == counts.num_batches
    prev = None
    for b, plan in enumerate(sim.plans):
        ctx = batch_context(counts, workload, b, cluster, model, cost, prev_home=prev, seed=options.seed)
        predicted = predict_batch_time(plan, ctx)
        assert predicted == sim.batch_time[b], (b, predicted, sim.batch_time[b])
        prev = plan.home
    assert np.mean(sim.batch_time) == sim.metrics["step_time_s"]
    if planner_name in TERMS:
        assert sim.metrics[TERMS[planner_name]] > 0, TERMS[planner_name]
    if cluster.ep_overlap:
        assert sim.metrics["t_comm_hidden_s"] > 0
    whole = [k for k in WHOLE_STEP_COLUMNS if k.startswith("t_pass_")]
    if cluster_name == "moe_step":
        assert all(sim.metrics[k] == 0.0 for k in WHOLE_STEP_COLUMNS if k not in whole)
    else:
        assert sim.metrics["t_other_s"] > 0 and sim.metrics["t_permute_s"] > 0
    if cluster_name == "rl_passes":
        assert sim.metrics["t_pass_recompute_s"] > 0 and sim.metrics["t_pass_reference_s"] > 0
    if cluster_name in ("rl_passes", "fp8_full"):
        assert sim.metrics["t_recompute_s"] > 0
    if cluster_name == "pipeline":
        assert sim.metrics["t_bubble_s"] > 0 and sim.metrics["t_p2p_s"] > 0
    if cluster_name == "tensor":
        assert sim.metrics["t_tp_comm_s"] > 0
    passes = sum(sim.metrics[k] for k in whole)
    assert passes == pytest.approx(sim.metrics["step_time_s"], rel=1e-12)

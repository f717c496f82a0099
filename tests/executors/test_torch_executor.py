"""The torch executor: plan refusal, equivalence with the unbalanced layer (gloo, CPU).

Equivalence cases run in one spawned process group per world size (world 4 = 2 nodes x 2 GPUs, world 8 =
2 x 4); the single-process reference is computed here and every case is checked by its own test.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re

import numpy as np
import pytest
import torch

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.executors.plan_check import PlanRefused, check_plan, routes_load
from relibra.executors.reorder_ops import moved_experts, reorder_experts
from relibra.executors.torch_executor import TorchExecutor, launch
from relibra.executors.torch_moe import (
    EPMoEModel,
    ExpertShape,
    MicroBatchPlan,
    dense_init,
    expert_init,
    reference_forward,
)
from relibra.invariants import PlanInvariantError
from relibra.planners.protocols import home_assign, static_placement
from relibra.types import BatchPlan
from tests.builders import hand_hardware

SHAPE = ExpertShape(hidden=8, ffn=4)
RTOL = 1e-5


# ------------------------------------------------------------------------------------ case builders
def _cluster(nodes: int, gpn: int) -> ClusterSpec:
    return ClusterSpec(nodes, gpn, hand_hardware("cpu", 1e12, 1e11, 1e10, 1e9))


def _tiny_model() -> ModelSpec:
    return ModelSpec("tiny", 2, 2, 8, 4, 8, 2, 2, 1, 4)


def random_routes(
    rng: np.random.Generator, tokens: int, num_layers: int, num_experts: int, k: int
) -> np.ndarray:
    """Distinct top-k experts per token: int64 [T, L, k]."""
    return np.argsort(rng.random((tokens, num_layers, num_experts)), axis=-1)[..., :k].astype(np.int64)


def random_home(rng: np.random.Generator, num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """A random permutation placement with E / G experts per GPU: int [L, E]."""
    base = np.repeat(np.arange(num_gpus), num_experts // num_gpus)
    return np.stack([rng.permutation(base) for _ in range(num_layers)])


def random_slot_plan(
    rng: np.random.Generator, load: np.ndarray, home: np.ndarray, gpus_per_node: int, r: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random replicas within the home node and a random token split over the copies.

    load [L, G, E], home [L, E] -> (assign [L, E, G], replicas [L, G, r]).
    """
    num_layers, num_gpus, num_experts = load.shape
    replicas = np.full((num_layers, num_gpus, r), -1, dtype=np.int64)
    assign = np.zeros((num_layers, num_experts, num_gpus), dtype=np.int64)
    for layer in range(num_layers):
        for g in range(num_gpus):
            node = g // gpus_per_node
            cand = [
                e
                for e in range(num_experts)
                if home[layer, e] != g and home[layer, e] // gpus_per_node == node
            ]
            pick: list[int] = list(rng.permutation(cand)[: rng.integers(0, r + 1)]) if cand and r else []
            replicas[layer, g, : len(pick)] = pick
        for e in range(num_experts):
            copies = [int(home[layer, e])] + [g for g in range(num_gpus) if e in replicas[layer, g]]
            total = int(load[layer, :, e].sum())
            share = rng.multinomial(total, rng.dirichlet(np.ones(len(copies))))
            assign[layer, e, copies] = share
    return assign, replicas


def make_case(
    name: str,
    rng: np.random.Generator,
    num_gpus: int,
    gpus_per_node: int,
    tokens: list[int],
    num_layers: int = 2,
    num_experts: int = 8,
    k: int = 2,
    r: int = 2,
    static: bool = False,
    routes: list[np.ndarray] | None = None,
) -> dict:
    if routes is None:
        routes = [random_routes(rng, t, num_layers, num_experts, k) for t in tokens]
    load = np.stack([routes_load(rt, num_experts) for rt in routes], axis=1)  # [L, G, E]
    if static:
        home = static_placement(num_layers, num_experts, num_gpus).astype(np.int64)
        assign, replicas = home_assign(load, home, num_gpus), np.full((num_layers, num_gpus, r), -1)
    else:
        home = random_home(rng, num_layers, num_experts, num_gpus)
        assign, replicas = random_slot_plan(rng, load, home, gpus_per_node, r)
    return finish_case(name, rng, MicroBatchPlan(home, assign, load, replicas if r else None), routes, k)


def finish_case(
    name: str, rng: np.random.Generator, plan: MicroBatchPlan, routes: list[np.ndarray], k: int
) -> dict:
    seed = int(rng.integers(1 << 30))
    hiddens = [
        torch.randn(len(rt), SHAPE.hidden, generator=torch.Generator().manual_seed(seed + j))
        for j, rt in enumerate(routes)
    ]
    gouts = [
        torch.randn(len(rt), SHAPE.hidden, generator=torch.Generator().manual_seed(seed - j - 1))
        for j, rt in enumerate(routes)
    ]
    gpn = 2 if len(routes) == 4 else 4
    return {
        "name": name,
        "plan": plan,
        "routes": routes,
        "hiddens": hiddens,
        "gouts": gouts,
        "k": k,
        "gpus_per_node": gpn,
    }


def as_batch_plan(plan: MicroBatchPlan) -> BatchPlan:
    """Wrap one micro-batch plan as a one-micro-batch BatchPlan (for check_plan)."""
    return BatchPlan(
        home=plan.home.astype(np.int32),
        assign=plan.assign[None].astype(np.int32),
        load=plan.load[None].astype(np.int32),
        sample_gpu=np.zeros(0, dtype=np.int32),
        replicas=None if plan.replicas is None else plan.replicas[None].astype(np.int32),
        redundant=None if plan.redundant is None else plan.redundant.astype(np.int32),
    )


# --------------------------------------------------------------------------- distributed worker
def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Per case: start from the static placement, reorder to the plan's, run forward + backward."""
    out = []
    for case in cases:
        plan: MicroBatchPlan = case["plan"]
        num_layers, num_experts = plan.home.shape
        r = 0 if plan.replicas is None else plan.replicas.shape[-1]
        red = 0 if plan.redundant is None else plan.redundant.shape[-1]
        same_node = case["name"] != "planner_popfetcher"
        check_plan(as_batch_plan(plan), world, case["gpus_per_node"], r, red, [case["routes"]], same_node)
        model = EPMoEModel(num_layers, num_experts, SHAPE, rank, world, r, red)
        model.place_initial(static_placement(num_layers, num_experts, world))
        moved = reorder_experts(model, plan.home)
        model.fill_redundant(plan.redundant)
        misplaced = max(
            float((model.experts[layer][i].detach() - expert_init(layer, int(e), SHAPE)).abs().max())
            for layer in range(num_layers)
            for i, e in enumerate(model.slot_expert[layer])
        )
        h = case["hiddens"][rank].clone().requires_grad_()
        y = model(h, case["routes"][rank], plan)
        (y * case["gouts"][rank]).sum().backward()
        out.append(
            {
                "out": y.detach(),
                "grad_hidden": h.grad,
                "grad_experts": [_grad(p) for p in model.experts],
                "slot_expert": model.slot_expert.copy(),
                "grad_attn": _grad(model.attn),
                "grad_router": _grad(model.router),
                "moved": moved,
                "misplaced": misplaced,
                "buffer_bytes": model.buffer.nbytes,
            }
        )
    return out


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "a parameter has no gradient after backward"
    return p.grad.clone()


def reference(case: dict, num_layers: int, num_experts: int) -> dict:
    """Single-process unbalanced layer: outputs and every parameter gradient."""
    attn = torch.stack(
        [dense_init(layer, SHAPE, num_experts)[0] for layer in range(num_layers)]
    ).requires_grad_()
    router = torch.stack(
        [dense_init(layer, SHAPE, num_experts)[1] for layer in range(num_layers)]
    ).requires_grad_()
    experts = torch.stack(
        [
            torch.stack([expert_init(layer, e, SHAPE) for e in range(num_experts)])
            for layer in range(num_layers)
        ]
    ).requires_grad_()
    outs, grads_h = [], []
    for rt, hid, gout in zip(case["routes"], case["hiddens"], case["gouts"]):
        h = hid.clone().requires_grad_()
        y = reference_forward(h, rt, attn, router, experts, SHAPE)
        (y * gout).sum().backward()
        outs.append(y.detach())
        grads_h.append(h.grad)
    return {
        "out": outs,
        "grad_hidden": grads_h,
        "grad_experts": experts.grad,
        "grad_attn": attn.grad,
        "grad_router": router.grad,
    }


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=RTOL * max(scale, 1e-12), msg=lambda m: f"{what}: {m}"
    )


def assert_equivalent(case: dict, ranks: list[dict]) -> None:
    plan: MicroBatchPlan = case["plan"]
    num_layers, num_experts = plan.home.shape
    ref = reference(case, num_layers, num_experts)
    for j, res in enumerate(ranks):
        assert res["misplaced"] == 0.0, f"rank {j} holds a weight row that is not the expert its slot names"
        close(res["out"], ref["out"][j], f"output of rank {j}")
        close(res["grad_hidden"], ref["grad_hidden"][j], f"input gradient of rank {j}")
    grad = torch.full_like(ref["grad_experts"], float("nan"))
    for res in ranks:
        for layer in range(num_layers):
            grad[layer, res["slot_expert"][layer]] = res["grad_experts"][layer]
    close(grad, ref["grad_experts"], "expert weight gradients")
    close(sum(r["grad_attn"] for r in ranks), ref["grad_attn"], "attention stand-in gradient")
    close(sum(r["grad_router"] for r in ranks), ref["grad_router"], "router gradient")


# ----------------------------------------------------------------------------------------- cases
@functools.cache
def world4_cases() -> list[dict]:
    rng = np.random.default_rng(4)
    g, gpn = 4, 2
    cases = [
        make_case("static_megatron", rng, g, gpn, [6, 5, 7, 4], static=True, r=0),
        make_case("random_replicas", rng, g, gpn, [6, 5, 7, 4], r=2),
        make_case("random_replicas_3_layers", rng, g, gpn, [9, 3, 5, 8], num_layers=3, r=1),
        make_case("r0_random_placement", rng, g, gpn, [5, 6, 3, 7], r=0),
        make_case("gpu_without_tokens", rng, g, gpn, [6, 0, 7, 0], r=2),
        make_case("no_tokens_at_all_on_one_layer_source", rng, g, gpn, [0, 0, 0, 3], r=1),
    ]
    # All tokens to one expert (top-1), replicated onto the other GPU of its node.
    routes = [np.full((t, 2, 1), 3, dtype=np.int64) for t in (5, 4, 6, 3)]
    load = np.stack([routes_load(rt, 8) for rt in routes], axis=1)
    home = static_placement(2, 8, g).astype(np.int64)  # expert 3 lives on GPU 1 (node 0)
    assign = home_assign(load, home, g).astype(np.int64)
    replicas = np.full((2, g, 1), -1, dtype=np.int64)
    replicas[:, 0, 0] = 3
    assign[:, 3, 0], assign[:, 3, 1] = 11, 7
    cases.append(
        finish_case("all_tokens_one_expert", rng, MicroBatchPlan(home, assign, load, replicas), routes, 1)
    )
    # An expert without tokens that is nevertheless replicated (its slot is filled, computes nothing).
    routes = [random_routes(rng, t, 2, 7, 2) + 1 for t in (5, 4, 6, 3)]  # expert 0 gets no token
    load = np.stack([routes_load(rt, 8) for rt in routes], axis=1)
    home = random_home(rng, 2, 8, g)
    replicas = np.full((2, g, 1), -1, dtype=np.int64)
    replicas[0, home[0, 0] ^ 1, 0], replicas[1, home[1, 0] ^ 1, 0] = 0, 0  # the other GPU of 0's node
    case = MicroBatchPlan(home, home_assign(load, home, g).astype(np.int64), load, replicas)
    cases.append(finish_case("replicated_expert_without_tokens", rng, case, routes, 2))
    # Permanent redundant slots (EPLB+ / LPLB+ style): copies may sit on another node.
    rt = [random_routes(rng, t, 2, 8, 2) for t in (6, 5, 4, 7)]
    load = np.stack([routes_load(x, 8) for x in rt], axis=1)
    home = random_home(rng, 2, 8, g)
    redundant = np.full((2, g, 1), -1, dtype=np.int64)
    assign = home_assign(load, home, g).astype(np.int64)
    for layer in range(2):
        for gpu in range(g):
            e = int(rng.choice(np.flatnonzero(home[layer] != gpu)))
            if e in redundant[layer]:
                continue
            redundant[layer, gpu, 0] = e
            total = int(load[layer, :, e].sum())
            assign[layer, e, gpu] = total // 2
            assign[layer, e, home[layer, e]] -= total // 2
    cases.append(
        finish_case("redundant_cross_node", rng, MicroBatchPlan(home, assign, load, None, redundant), rt, 2)
    )
    cases += planner_cases(rng, g, gpn)
    return cases


def _planners(gpus_per_node: int) -> list:
    """Every planner present in the project, with small slot counts (absent modules are skipped)."""
    found = []
    candidates: list[tuple[str, str, dict[str, object]]] = [
        ("baselines.megatron", "MegatronPlanner", {}),
        ("baselines.eplb", "EplbPlanner", {"redundant_slots": 1}),
        ("baselines.lplb", "LplbPlanner", {"redundant_slots": 2, "topology": "ring"}),
        ("baselines.popfetcher", "PopFetcherPlanner", {"replica_slots": 1}),
        ("relibra.planners.reorder_only", "ReorderOnlyPlanner", {}),
        ("relibra.planners.compose", "ReLibraPlanner", {"replica_slots": 2}),
        ("relibra.planners.compose", "ReplicateOnlyPlanner", {"replica_slots": 2}),
    ]
    for module, cls, kwargs in candidates:
        try:
            mod = __import__(module, fromlist=[cls])
            found.append(getattr(mod, cls)(**kwargs))
        except (ImportError, AttributeError, TypeError, ValueError):
            continue
    return found


def planner_cases(rng: np.random.Generator, num_gpus: int, gpus_per_node: int) -> list[dict]:
    """Plans from every planner present in the project on random routes (2 samples per GPU, 1 micro-batch).

    A planner may move samples between GPUs (locality round); each rank then holds its plan's samples.
    """
    from relibra.cost.model import CostModel
    from relibra.planners.protocols import BatchContext

    num_layers, num_experts, k = 2, 8, 2
    sample_routes = [
        random_routes(rng, int(t), num_layers, num_experts, k) for t in rng.integers(1, 6, 2 * num_gpus)
    ]
    counts = np.stack([routes_load(rt, num_experts) for rt in sample_routes]).astype(np.int32)  # [S, L, E]
    sample_gpu = (np.arange(len(sample_routes)) % num_gpus).astype(np.int32)
    cluster = _cluster(num_gpus // gpus_per_node, gpus_per_node)
    model = ModelSpec("tiny", num_layers, num_layers, SHAPE.hidden, SHAPE.ffn, num_experts, k, 2, 1, 4)
    out = []
    for planner in _planners(gpus_per_node):
        load = np.zeros((1, num_layers, num_gpus, num_experts), dtype=np.int32)
        np.add.at(load[0].transpose(1, 0, 2), sample_gpu, counts)
        ctx = BatchContext(
            batch=0,
            counts=counts,
            sample_tokens=np.array([len(r) for r in sample_routes], dtype=np.int64),
            sample_gpu=sample_gpu,
            sample_mb=np.zeros(len(sample_routes), dtype=np.int32),
            load=load,
            cluster=cluster,
            model=model,
            cost=CostModel(cluster, model),
            history=(load,),
            regroup=None,
        )
        try:
            plan = planner.plan(ctx)
        except Exception as err:
            print(f"planner {planner.name} skipped: {err}")
            continue
        routes = [
            np.concatenate(
                [sample_routes[s] for s in np.flatnonzero(plan.sample_gpu == g)]
                or [np.zeros((0, num_layers, k), dtype=np.int64)]
            )
            for g in range(num_gpus)
        ]
        mb = MicroBatchPlan(
            plan.home.astype(np.int64),
            plan.assign[0].astype(np.int64),
            plan.load[0].astype(np.int64),
            None if plan.replicas is None else plan.replicas[0].astype(np.int64),
            None if plan.redundant is None else plan.redundant.astype(np.int64),
        )
        out.append(finish_case(f"planner_{planner.name}", rng, mb, routes, k))
    return out


@pytest.fixture(scope="module")
def world4() -> tuple[list[dict], list[list[dict]]]:
    cases = world4_cases()
    ranks = launch(run_cases, 4, cases, start_method="fork")
    return cases, [[ranks[j][i] for j in range(4)] for i in range(len(cases))]


CASE_NAMES = [c["name"] for c in world4_cases()]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_world4_equals_unbalanced_layer(world4, name: str) -> None:
    cases, results = world4
    i = CASE_NAMES.index(name)
    plan = as_batch_plan(cases[i]["plan"])
    r = 0 if plan.replicas is None else plan.replicas.shape[-1]
    red = 0 if plan.redundant is None else plan.redundant.shape[-1]
    same_node = name != "planner_popfetcher"  # NOTE: PopFetcher's prefetch buffer may pull across nodes.
    check_plan(plan, 4, 2, r, red, routes=[cases[i]["routes"]], replica_same_node=same_node)
    assert_equivalent(cases[i], results[i])


def test_world4_reports_reordering(world4) -> None:
    cases, results = world4
    for case, ranks in zip(cases, results):
        home = case["plan"].home
        expect = len(moved_experts(static_placement(home.shape[0], home.shape[1], 4), home))
        assert all(r["moved"] == expect for r in ranks), case["name"]


def test_world8_equals_unbalanced_layer() -> None:
    rng = np.random.default_rng(8)
    cases = [
        make_case(
            "w8_random_replicas", rng, 8, 4, [3, 2, 4, 0, 3, 2, 1, 3], num_layers=2, num_experts=16, r=2
        ),
    ]
    results = launch(run_cases, 8, cases, start_method="fork")
    assert_equivalent(cases[0], [results[j][0] for j in range(8)])


def test_mismatched_reference_is_caught() -> None:
    """The equivalence check itself fails for a wrong expert weight (the check can fail)."""
    rng = np.random.default_rng(0)
    case = make_case("x", rng, 2, 2, [3, 2], num_experts=4, r=0, static=True)
    ref = reference(case, 2, 4)
    fake = [
        {
            "misplaced": 0.0,
            "out": ref["out"][j] * (1 + 1e-3),
            "grad_hidden": ref["grad_hidden"][j],
            "slot_expert": np.array([[2 * j, 2 * j + 1]] * 2),
            "grad_experts": [ref["grad_experts"][layer, 2 * j : 2 * j + 2] for layer in range(2)],
            "grad_attn": ref["grad_attn"] / 2,
            "grad_router": ref["grad_router"] / 2,
        }
        for j in range(2)
    ]
    with pytest.raises(AssertionError, match="output of rank 0"):
        assert_equivalent(case, fake)


# ------------------------------------------------------------------------------------ plan refusal
def _valid_plan() -> tuple[BatchPlan, list]:
    rng = np.random.default_rng(1)
    routes = [random_routes(rng, t, 2, 8, 2) for t in (5, 4, 6, 3)]
    load = np.stack([routes_load(rt, 8) for rt in routes], axis=1)
    home = random_home(rng, 2, 8, 4)
    assign, replicas = random_slot_plan(rng, load, home, 2, 2)
    replicas[0, 0] = -1
    e = next(e for e in range(8) if home[0, e] == 1)
    replicas[0, 0, 0] = e
    total = load[0, :, e].sum()
    assign[0, e] = 0
    assign[0, e, 0], assign[0, e, 1] = total // 2 + 1, total - total // 2 - 1
    for x in range(8):  # nothing else computed on GPU 0 off-home in layer 0
        if x != e and home[0, x] != 0 and assign[0, x, 0] > 0:
            assign[0, x, home[0, x]] += assign[0, x, 0]
            assign[0, x, 0] = 0
    return as_batch_plan(MicroBatchPlan(home, assign, load, replicas)), [routes]


def _mutate(invariant: str) -> tuple[BatchPlan, list]:
    plan, routes = _valid_plan()
    assert plan.replicas is not None
    home, assign, load, reps = plan.home.copy(), plan.assign.copy(), plan.load.copy(), plan.replicas.copy()
    e = int(reps[0, 0, 0, 0])
    if invariant == "shape":
        assign = assign[..., :3]
    elif invariant == "dtype":
        assign = assign.astype(np.int64)
    elif invariant == "load >= 0":
        load[0, 0, 0, 0] = -1
    elif invariant == "slot range":
        reps[0, 0, 0, 1] = 8
    elif invariant == "home range":
        home[1, 0] = 9
    elif invariant == "home balance":
        a, b = np.flatnonzero(home[1] == 0)[0], np.flatnonzero(home[1] == 1)[0]
        home[1, b] = 0
        assert a != b
    elif invariant == "assign >= 0":
        assign[0, 0, 0, 0] = -1
    elif invariant == "token conservation":
        assign[0, 1, e, 1] += 1
    elif invariant == "slot capacity":
        reps = np.concatenate([reps, reps[..., :1] * 0 - 1], axis=-1)
    elif invariant == "slot duplicate":
        reps[0, 0, 0, 1] = e
    elif invariant == "replicas in home node":
        far = int(np.flatnonzero(home[0] == 2)[0])
        reps[0, 0, 0, 1] = far
    elif invariant == "slot contents":
        reps[0, 0, 0, 0] = -1
    elif invariant == "routes match load":
        load[0, 0, 0, e] += 1
        load[0, 0, 1, e] -= 1 if load[0, 0, 1, e] > 0 else -1
        assign[0, 0, e, 1] += load[0, 0, :, e].sum() - assign[0, 0, e, :].sum()
    return dataclasses.replace(plan, home=home, assign=assign, load=load, replicas=reps), routes


INVARIANTS = [
    "shape",
    "dtype",
    "load >= 0",
    "slot range",
    "home range",
    "home balance",
    "assign >= 0",
    "token conservation",
    "slot capacity",
    "slot duplicate",
    "replicas in home node",
    "slot contents",
    "routes match load",
]


def test_valid_plan_is_accepted() -> None:
    plan, routes = _valid_plan()
    check_plan(plan, 4, 2, 2, routes=routes)


@pytest.mark.parametrize("invariant", INVARIANTS)
def test_wrong_plan_is_refused_naming_the_invariant(invariant: str) -> None:
    plan, routes = _mutate(invariant)
    with pytest.raises(PlanRefused, match=re.escape(f"[{invariant}]")) as err:
        check_plan(plan, 4, 2, 2, routes=routes)
    assert err.value.invariant == invariant
    assert isinstance(err.value, PlanInvariantError)  # one exception family with the shared checker
    again = pickle.loads(pickle.dumps(err.value))  # ranks report refusals across processes
    assert type(again) is PlanRefused and again.invariant == invariant and str(again) == str(err.value)


def test_redundant_wider_than_the_executor_slots_is_refused() -> None:
    plan, routes = _valid_plan()
    num_layers, num_gpus = plan.home.shape[0], plan.assign.shape[-1]
    red = np.full((num_layers, num_gpus, 2), -1, dtype=np.int32)
    wide = dataclasses.replace(plan, redundant=red)
    check_plan(wide, 4, 2, 2, redundant_slots=2, routes=routes)
    with pytest.raises(PlanRefused, match=re.escape("[slot capacity]")) as err:
        check_plan(wide, 4, 2, 2, redundant_slots=1, routes=routes)
    assert "redundant" in str(err.value)


def test_world_size_must_match_the_plan() -> None:
    plan, _ = _valid_plan()
    with pytest.raises(PlanRefused, match=re.escape("[shape]")):
        check_plan(plan, 8, 2, 2)


def test_executor_refuses_before_any_process_starts(monkeypatch) -> None:
    import relibra.executors.torch_executor as tex

    def no_launch(*args, **kwargs):
        raise AssertionError("processes were started for a plan that should have been refused")

    monkeypatch.setattr(tex, "launch", no_launch)
    plan, _ = _mutate("replicas in home node")
    with pytest.raises(PlanRefused, match="replicas in home node"):
        TorchExecutor(replica_slots=2).execute([plan], _tiny_model(), _cluster(2, 2))


# ---------------------------------------------------------------------------------------- executor
def test_executor_measures_every_microbatch_and_layer() -> None:
    rng = np.random.default_rng(3)
    plans = []
    for b in range(2):
        mb = [make_case(f"b{b}m{m}", rng, 4, 2, [4, 6, 2, 5], r=1) for m in range(2)]
        home = mb[0]["plan"].home
        assign = []
        for c in mb:  # one placement per batch: recompute the split of the second micro-batch on it
            a, reps = random_slot_plan(rng, c["plan"].load, home, 2, 1)
            assign.append((a, reps, c["plan"].load))
        plans.append(
            BatchPlan(
                home=home.astype(np.int32),
                assign=np.stack([a for a, _, _ in assign]).astype(np.int32),
                load=np.stack([x for _, _, x in assign]).astype(np.int32),
                sample_gpu=np.zeros(0, dtype=np.int32),
                replicas=np.stack([r for _, r, _ in assign]).astype(np.int32),
            )
        )
    report = TorchExecutor(hidden=8, moe_ffn=4, start_method="fork").execute(
        plans, _tiny_model(), _cluster(2, 2)
    )
    assert report.moe_time_s.shape == (4, 2)
    assert np.isfinite(report.moe_time_s).all() and (report.moe_time_s > 0).all()
    moved = len(moved_experts(plans[0].home, plans[1].home))
    assert report.extra["reorder_moved_experts"] == moved
    assert report.extra["replica_buffer_bytes"] == 2 * 1 * ExpertShape(8, 4).params * 4


# ------------------------------------------------------------------------------------ calibration
def test_calibration_dry_run_writes_the_documented_format(tmp_path) -> None:
    import importlib.util
    import json

    from relibra.cluster import ModelSpec as _  # noqa: F401  (the script must not need anything else)

    spec = importlib.util.spec_from_file_location("calibrate_gpu", "scripts/calibrate_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "cal.json"
    mod.main(["--dry-run", "--out", str(out), "--models", "qwen3-30b-a3b", "olmoe-1b-7b"])
    cal = json.loads(out.read_text())
    assert {"gpu", "driver", "torch", "date"} <= set(cal["provenance"]) and cal["provenance"]["dry_run"]
    assert set(cal["models"]) == {"qwen3-30b-a3b", "olmoe-1b-7b"}
    for row in cal["models"].values():
        assert len(row["tokens"]) == len(row["fwd_s"]) == len(row["bwd_s"]) == len(row["seconds"]) == 4
        assert all(t > 0 for t in row["fwd_s"])
        np.testing.assert_allclose(row["seconds"], np.add(row["fwd_s"], row["bwd_s"]))
    assert cal["d2d_bytes_per_s"] > 0

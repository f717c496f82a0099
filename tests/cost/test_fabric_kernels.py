"""Every compiled link kernel against the one fabric model (:mod:`relibra.cost.fabric`), on random cases.

The planners search over their own compiled copies of the rail-optimized link arithmetic; the simulator
prices plans with :class:`relibra.cost.model.CostModel`, which calls :mod:`relibra.cost.fabric`. This module
is the one place that pins every copy to the fabric, per (micro-batch, GPU) and per link direction, for
random loads, placements and token splits over several cluster shapes (one node included, and NVLink
domains of several nodes, ``cluster.nvl_domain``) and both dispatchers:

* the annealer (:mod:`relibra.planners.reorder.anneal`, routes from :mod:`relibra.planners.reorder.links`):
  the link state of :func:`full_state` / :func:`full_state_deepep`, the same state after incremental swaps,
  the per-GPU time of :func:`comm_gpu`, and the communication term of :func:`placement_objective`;
* the greedy replication (:mod:`relibra.planners.replicate.greedy`): the traffic of ``_node_traffic``, the
  link totals of ``_gpu_link_totals`` and ``_deepep_link_totals``, the per-GPU time of ``_comm_per_gpu`` /
  ``_comm_from_totals`` and the bound ``_comm_lower_bound``, with the coefficients of
  :meth:`ReplicationCoefficients.from_cost`;
* the locality round (:mod:`relibra.planners.reorder.locality`): its link state, its incremental sample
  move and its summed communication objective (``alltoall`` only: the round runs on that proxy, see its
  module docstring);
* the replication MILP (:mod:`relibra.planners.replicate.milp`, ``alltoall`` only: it refuses ``deepep``):
  its link coefficients at a random feasible split, and the communication term of a solved LP split.

Tolerances, as each comparison holds them (observed over 1,000 random cases on the shapes below and EP
16 / 64, both dispatchers): link loads summed from integer token counts are compared bitwise; float link
loads (a fractional split, the ``deepep`` estimate's ``expm1`` / ``exp`` of log-miss sums) at
``rtol=1e-12`` (observed 3e-14), and after 20 ``deepep`` swaps, whose rescaled miss probabilities drift, at
``rtol=1e-10`` (observed 3e-13); seconds at ``rtol=1e-12`` (observed 8e-16), except
``_comm_lower_bound``, shrunk by design by its ``1e-9`` slack. The LP's objective, read back from GLOP, at
``rtol=1e-9`` (observed 5e-16).

FP8 dispatch (``cluster.precision=fp8``: one byte per value plus a scale per 128, combine bf16): every
kernel prices a dispatch and a combine phase at its own bytes per token (:meth:`CostModel.linear`'s
per-phase coefficients), checked by ``test_kernels_price_fp8_dispatch_as_the_cost_model``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.fabric import LINK_KEYS, deepep_link_tokens_estimate, mirrored, rail_link_bytes
from relibra.cost.model import CostModel
from relibra.planners.protocols import home_assign
from relibra.planners.reorder.kernels import (
    _apply_swap,
    _apply_swap_deepep,
    full_state,
    full_state_deepep,
    placement_objective,
)
from relibra.planners.reorder.links import comm_coefficients, comm_gpu, deepep_routes, link_routes
from relibra.planners.reorder.locality import _comm_total, _link_state, _move, per_gpu_slots
from relibra.planners.reorder.problem import LayerProblem, layer_problem
from relibra.planners.replicate.links import _comm_lower_bound, _deepep_link_totals, _gpu_link_totals
from relibra.planners.replicate.milp import solve_split
from relibra.planners.replicate.milp_model import _link_coefficients, dispatch_routing
from relibra.planners.replicate.state import _NO_OVERLAP, ALL_NODES, _home_state, _objective, _problem
from relibra.planners.replicate.terms import ReplicationCoefficients
from tests.builders import HOPPER

SHAPES = (
    (1, 4, None), (1, 8, None), (2, 2, None), (2, 4, None), (4, 2, None), (3, 2, None), (2, 8, None),
    (4, 2, 4), (2, 2, 4), (4, 2, 8), (6, 2, 4),
)  # fmt: skip
"""(nodes, gpus_per_node, nvl_domain) of the default run: one node, square and flat shapes, an odd node
count; NVLink domains of two and four nodes (one domain holding the whole group among them)."""
BIG_SHAPES = ((4, 4, None), (8, 8, None), (16, 4, 16))
"""Added by the slow test."""
HW = replace(HOPPER, nvlink_efficiency=0.685, nic_efficiency=0.875)
"""The calibrated link efficiencies of conf/cluster/hopper.yaml, so that NVLink and NIC rates differ
as they do in runs."""
TOP_K = 4

FLOAT_RTOL = 1e-12
"""Float link loads; also their ``atol`` in tokens (a load zero on one side, rounding noise on the other)."""
DRIFT_RTOL = 1e-10
"""Float link loads after incremental ``deepep`` swaps (each rescales miss probabilities)."""
SECONDS_RTOL = 1e-12
LP_RTOL = 1e-9
"""The LP split's objective, read back from the solver (observed 5e-16 with GLOP)."""


@dataclass(frozen=True)
class Case:
    """One random problem: a cluster, per-token routes reduced to loads, a placement and a token split."""

    cost: CostModel
    load: np.ndarray
    """int64 [Mb, G, E]: ``x[m, j, e]``, from ``T_j`` tokens per source, each with ``TOP_K`` distinct
    experts (so ``x[m, j, e] <= T_j`` and ``sum_e x[m, j, e] = TOP_K * T_j``, as the estimate assumes)."""
    home: np.ndarray
    """int64 [E]: a random placement with ``E / G`` experts per GPU."""
    split: np.ndarray
    """float64 [Mb, E, G]: a random token split over GPUs of each expert's home node, home always holding
    a share (the replication's feasible set)."""

    @property
    def nodes(self) -> int:
        """NVLink domains: the fabric's "nodes" (``cluster.num_domains``)."""
        return self.cost.cluster.num_domains

    @property
    def gpn(self) -> int:
        """GPUs per NVLink domain (``cluster.domain_gpus``)."""
        return self.cost.cluster.domain_gpus

    @property
    def num_gpus(self) -> int:
        return self.cost.cluster.num_gpus

    @property
    def deepep(self) -> bool:
        return self.cost.dispatcher == "deepep"

    def home_assign(self) -> np.ndarray:
        """int32 [Mb, E, G]: every expert at home."""
        mb = self.load.shape[0]
        return home_assign(self.load, np.broadcast_to(self.home, (mb, self.home.size)), self.num_gpus)


def make_case(nodes: int, gpn: int, dispatcher: str, seed: int, nvl_domain: int | None = None) -> Case:
    """A :class:`Case` on ``nodes x gpn`` GPUs in NVLink domains of ``nvl_domain`` (numpy streams from
    ``seed``)."""
    rng = np.random.default_rng(seed)
    g = nodes * gpn
    per_gpu = max(int(rng.integers(1, 4)), -(-2 * TOP_K // g))  # E >= 2 * TOP_K experts
    e = g * per_gpu
    mb = int(rng.integers(1, 4))
    model = ModelSpec("kernels-moe", 2, 2, 2048, 768, e, TOP_K, 16, 4, 128)
    cost = CostModel(ClusterSpec(nodes, gpn, HW, dispatcher=dispatcher, nvl_domain=nvl_domain), model)
    gpn = cost.cluster.domain_gpus  # NOTE: splits stay in the expert's NVLink domain.
    popularity = rng.dirichlet(np.full(e, float(rng.choice([0.2, 1.0, 5.0]))))
    load = np.zeros((mb, g, e), dtype=np.int64)
    for m in range(mb):
        tokens = rng.integers(0, 80, size=g)
        tokens[rng.random(g) < 0.15] = 0  # some sources hold nothing
        for j in range(g):
            # Gumbel top-k: TOP_K distinct experts per token, the popular ones more often.
            keys = np.log(popularity + 1e-300) + rng.gumbel(size=(tokens[j], e))
            picked = np.argpartition(-keys, TOP_K - 1, axis=1)[:, :TOP_K]
            load[m, j] = np.bincount(picked.ravel(), minlength=e)
    home = rng.permutation(np.arange(e) % g).astype(np.int64)
    split = np.zeros((mb, e, g))
    first = (home // gpn) * gpn
    for m in range(mb):
        for ex in range(e):
            w = rng.random(gpn) * (rng.random(gpn) < 0.4)
            w[home[ex] % gpn] += rng.random() + 0.05
            split[m, ex, first[ex] : first[ex] + gpn] = w / w.sum() * load[m, :, ex].sum()
    return Case(cost=cost, load=load, home=home, split=split)


@st.composite
def cases(
    draw: st.DrawFn,
    shapes: tuple[tuple[int, int, int | None], ...] = SHAPES,
    dispatchers=("alltoall", "deepep"),
):
    nodes, gpn, domain = draw(st.sampled_from(shapes))
    dispatcher = draw(st.sampled_from(dispatchers))
    return make_case(nodes, gpn, dispatcher, draw(st.integers(0, 2**32 - 1)), domain)


def _dispatch_and_combine(dispatch: dict[str, np.ndarray], combine: dict[str, np.ndarray]) -> np.ndarray:
    """The eight one-way link loads [..., 8, G] in :data:`relibra.planners.reorder.links.NUM_LINKS` order."""
    return np.stack([dispatch[k] for k in LINK_KEYS] + [combine[k] for k in LINK_KEYS], axis=-2)


def fabric_links(case: Case, assign: np.ndarray) -> np.ndarray:
    """The fabric's eight link loads [Mb, 8, G] (tokens) of ``case.load`` under ``assign`` [Mb, E, G]."""
    c = case.cost
    if not case.deepep:
        traffic = c.traffic(case.load, assign)
        return _dispatch_and_combine(
            rail_link_bytes(traffic, case.nodes, case.gpn),
            rail_link_bytes(np.swapaxes(traffic, -1, -2), case.nodes, case.gpn),
        )
    x = case.load.astype(np.float64)
    links = deepep_link_tokens_estimate(x, c.share(assign), x.sum(-1) / TOP_K, case.nodes, case.gpn)
    return _dispatch_and_combine(links, mirrored(links))


def assert_links(got: np.ndarray, want: np.ndarray, exact: bool, rtol: float = FLOAT_RTOL) -> None:
    """Link loads [..., 8, G]: bitwise (``exact``, integer token sums) or to ``rtol``."""
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


# ------------------------------------------------------------------------------------------ annealer
def annealer_state(case: Case, home: np.ndarray) -> tuple[LayerProblem, np.ndarray, tuple[np.ndarray, ...]]:
    """(problem, link [Mb, 8, G], the state tuple) of the annealer from scratch for placement ``home``."""
    problem = layer_problem(case.load, case.cost)
    assert problem.deepep == case.deepep
    state: tuple[np.ndarray, ...]
    if case.deepep:
        routes = deepep_routes(case.nodes, case.gpn)
        state = full_state_deepep(home, problem.lq, problem.tok, problem.w, routes, case.nodes, problem.mig)
    else:
        idx, cnt = link_routes(case.nodes, case.gpn)
        state = full_state(home, problem.x, problem.w, idx, cnt, problem.mig)
    return problem, state[1].reshape(case.load.shape[0], 8, case.num_gpus), state


def check_annealer_links(case: Case) -> None:
    """The annealer's link state [Mb, 8 * G] for a random placement is the fabric's."""
    _, link, _ = annealer_state(case, case.home)
    assert_links(link, fabric_links(case, case.home_assign()), exact=not case.deepep)


def check_annealer_comm_time(case: Case) -> None:
    """Per (micro-batch, GPU), :func:`comm_gpu` of that state is the cost model's all-to-all seconds."""
    problem, link, _ = annealer_state(case, case.home)
    mb, g = case.load.shape[0], case.num_gpus
    flat = link.reshape(mb, 8 * g)
    ours = np.array([[comm_gpu(flat[m], k, g, problem.coef) for k in range(g)] for m in range(mb)])
    want = case.cost.moe_comm_time(case.load, case.home_assign())  # [Mb, G]
    np.testing.assert_allclose(ours * problem.scale, want, rtol=SECONDS_RTOL)
    # The objective's communication term (compute and migration zeroed): sum_m max_g T_comm(g).
    no_compute = replace(problem, w=np.zeros_like(problem.w))
    total = placement_objective(no_compute, case.home, case.cost.cluster)
    np.testing.assert_allclose(total, want.max(axis=-1).sum(), rtol=SECONDS_RTOL)


def check_annealer_swaps(case: Case, swaps: int = 20) -> None:
    """The incrementally updated state equals the fabric's for the placement the swaps reach."""
    rng = np.random.default_rng(case.load.sum())
    problem, _, state = annealer_state(case, case.home)
    home = case.home.copy()
    for _ in range(swaps):
        a = int(rng.integers(home.size))
        b = int(rng.choice(np.flatnonzero(home != home[a])))
        p, q = int(home[a]), int(home[b])
        if case.deepep:
            routes = deepep_routes(case.nodes, case.gpn)
            _apply_swap_deepep(
                a, b, p, q, problem.lq, problem.tok, problem.w, routes, case.nodes, problem.mig, *state
            )
        else:
            idx, cnt = link_routes(case.nodes, case.gpn)
            _apply_swap(a, b, p, q, problem.x, problem.w, idx, cnt, problem.mig, *state)
        home[a], home[b] = q, p
    moved = replace(case, home=home)
    link = state[1].reshape(case.load.shape[0], 8, case.num_gpus)
    # NOTE: alltoall's swaps add and subtract integer token counts: exact; deepep's rescale probabilities.
    assert_links(link, fabric_links(moved, moved.home_assign()), exact=not case.deepep, rtol=DRIFT_RTOL)


# -------------------------------------------------------------------------------- greedy replication
def greedy_state(case: Case, m: int):
    """(problem, state) of the greedy for micro-batch ``m`` with ``case.split`` as its split, evaluated."""
    coef = ReplicationCoefficients.from_cost(case.cost)
    x = case.load[m].astype(np.float64)
    p = _problem(
        x, case.home, case.gpn, 2, coef.fixed_tokens, coef.nvlink_per_token, coef.nic_per_token,
        3, 4, 1e-9, TOP_K if case.deepep else 0, _NO_OVERLAP, coef.dispatch_scale,
    )  # fmt: skip
    s = _home_state(p)
    base = (case.home // case.gpn) * case.gpn
    for e in range(case.home.size):
        s.a[e] = case.split[m, e, base[e] : base[e] + case.gpn]
        s.has[e] = s.a[e] > 0
        s.has[e, case.home[e] % case.gpn] = True
    _objective(p, s, True, ALL_NODES, np.inf)  # rebuilds the traffic (every node) and the per-GPU comm
    return p, s


def check_greedy(case: Case) -> None:
    """Traffic, link totals, per-GPU time and its lower bound of the greedy for a random split."""
    coef = ReplicationCoefficients.from_cost(case.cost)
    c = case.cost
    want_links = fabric_links(case, case.split)  # [Mb, 8, G]
    want_s = c.moe_comm_time(case.load, case.split)  # [Mb, G]
    lat = coef.latency * coef.seconds_per_token
    for m in range(case.load.shape[0]):
        p, s = greedy_state(case, m)
        if case.deepep:
            # The traffic matrix holds the log-miss sums: sum_e log(1 - q[j, e]) * share[e, g].
            lq = np.log1p(-np.minimum(case.load[m] / np.maximum(p.tok, 1e-300)[:, None], 1 - 1e-12))
            lq[p.tok <= 0] = 0.0
            np.testing.assert_allclose(
                s.traffic, lq @ c.share(case.split[m]), rtol=FLOAT_RTOL, atol=FLOAT_RTOL
            )
            totals = _deepep_link_totals(s.traffic, p.tok, case.gpn)
            assert_links(totals, want_links[m], exact=False)
        else:
            np.testing.assert_allclose(
                s.traffic, c.traffic(case.load[m], case.split[m]), rtol=FLOAT_RTOL, atol=FLOAT_RTOL
            )
            totals = np.stack([_gpu_link_totals(s.traffic, case.gpn, g) for g in range(case.num_gpus)], 1)
            assert_links(totals, want_links[m], exact=False)
            bound = np.array(
                [_comm_lower_bound(s.traffic, case.gpn, p.nvl, p.nic, g, p.dsc) for g in range(case.num_gpus)]
            )
            assert np.all(bound <= s.comm)
            np.testing.assert_allclose(bound, s.comm, rtol=2e-9)
        np.testing.assert_allclose(s.comm * coef.seconds_per_token + lat, want_s[m], rtol=SECONDS_RTOL)


# ---------------------------------------------------------------------------------------- locality
def check_locality(case: Case) -> None:
    """The locality round's link state, sample move and objective (``alltoall``; samples = sources)."""
    assert not case.deepep
    rng = np.random.default_rng(case.load.sum() + 1)
    g = case.num_gpus
    idx, cnt = link_routes(case.nodes, case.gpn)
    coef = comm_coefficients(case.cost)
    # Each micro-batch's loads as the round sees them: layers in place of micro-batches, one sample per
    # source GPU (sample s on GPU s), so that moving sample u to v moves all of u's tokens.
    load = case.load  # [L, G(j), E]
    layers = load.shape[0]
    home_l = np.broadcast_to(case.home, (layers, case.home.size))
    slots = per_gpu_slots(load.transpose(1, 0, 2), home_l, g)  # [S = G, L, G]: sample s's slots per home
    traffic = slots.transpose(1, 0, 2)  # [L, G(j), G(g)], as the round builds it
    link = _link_state(np.ascontiguousarray(traffic), idx, cnt)
    assert_links(link.reshape(layers, 8, g), fabric_links(case, case.home_assign()), exact=True)
    want = case.cost.moe_comm_time(load, case.home_assign()).max(axis=-1).sum()
    np.testing.assert_allclose(_comm_total(link, coef, g), want, rtol=SECONDS_RTOL)
    u, v = (int(i) for i in rng.choice(g, size=2, replace=False))
    _move(np.ascontiguousarray(slots[u]), u, v, link, idx, cnt)
    moved_load = load.copy()
    moved_load[:, v] += moved_load[:, u]
    moved_load[:, u] = 0
    moved = replace(case, load=moved_load)
    assert_links(link.reshape(layers, 8, g), fabric_links(moved, moved.home_assign()), exact=True)


# -------------------------------------------------------------------------------------------- MILP
def check_milp_coefficients(case: Case, routing: np.ndarray | None = None) -> None:
    """The MILP's per-token link coefficients, priced at the case's split, are the fabric's link loads, and
    its communication term (``2 * (p_dispatch + p_combine)``) is the cost model's per-GPU time."""
    assert not case.deepep
    c = case.cost
    coef = ReplicationCoefficients.from_cost(c)
    routing = dispatch_routing(c) if routing is None else routing
    gpu_of = (case.home // case.gpn * case.gpn)[:, None] + np.arange(case.gpn)  # [E, gpn]
    want_links = fabric_links(case, case.split)
    want_s = c.moe_comm_time(case.load, case.split)
    weights = np.array([coef.nvlink_per_token] * 2 + [coef.nic_per_token] * 2)
    for m in range(case.load.shape[0]):
        x = case.load[m].astype(np.float64)
        a = np.take_along_axis(case.split[m], gpu_of, axis=1)  # [E, gpn]
        disp, comb = _link_coefficients(x, x.sum(axis=0), gpu_of, routing)  # [4, G, E, gpn] each
        links = np.concatenate([np.einsum("coek,ek->co", k, a) for k in (disp, comb)])  # [8, G]
        assert_links(links, want_links[m], exact=False)
        scale = np.array([coef.dispatch_scale, 1.0])[:, None, None]  # a dispatch phase at its own bytes
        p = (links.reshape(2, 4, -1) * weights[None, :, None] * scale).max(
            axis=1
        )  # [2, G]: p_dispatch, p_combine
        t = (2.0 * p.sum(axis=0) + coef.latency) * coef.seconds_per_token
        np.testing.assert_allclose(t, want_s[m], rtol=SECONDS_RTOL)


# ------------------------------------------------------------------------------------------- tests
FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(case=cases())
def test_annealer_link_state_is_the_fabric(case: Case) -> None:
    check_annealer_links(case)


@FAST
@given(case=cases())
def test_annealer_comm_time_is_the_cost_model(case: Case) -> None:
    check_annealer_comm_time(case)


@FAST
@given(case=cases())
def test_annealer_swaps_keep_the_fabric_state(case: Case) -> None:
    check_annealer_swaps(case)


@FAST
@given(case=cases())
def test_greedy_kernels_price_a_split_as_the_cost_model(case: Case) -> None:
    check_greedy(case)


@FAST
@given(case=cases(dispatchers=("alltoall",)))
def test_locality_kernels_are_the_fabric(case: Case) -> None:
    check_locality(case)


@settings(max_examples=15, deadline=None)
@given(
    case=cases(
        shapes=((1, 4, None), (2, 2, None), (2, 4, None), (4, 2, None), (3, 2, None), (4, 2, 4)),
        dispatchers=("alltoall",),
    )
)
def test_milp_coefficients_are_the_fabric(case: Case) -> None:
    check_milp_coefficients(case)


@pytest.mark.parametrize(("nodes", "gpn", "seed"), [(1, 4, 0), (2, 2, 1), (2, 4, 2)])
def test_milp_split_objective_prices_communication_as_the_cost_model(nodes: int, gpn: int, seed: int) -> None:
    """At the LP split's optimum (a feasible point of the MILP), its objective minus its compute term is the
    cost model's ``max_g T_comm`` of the split it returns."""
    case = make_case(nodes, gpn, "alltoall", seed)
    c = case.cost
    coef = ReplicationCoefficients.from_cost(c)
    copies = case.split[0] > 0
    sol = solve_split(case.load[0], case.home, c, copies)
    comm = sol.objective_s - sol.compute_tokens.max() * coef.seconds_per_token
    want = c.moe_comm_time(case.load[0], sol.assign).max()
    np.testing.assert_allclose(comm, want, rtol=LP_RTOL)


CHECKS = {
    "annealer_links": check_annealer_links,
    "annealer_comm_time": check_annealer_comm_time,
    "annealer_swaps": check_annealer_swaps,
    "greedy": check_greedy,
    "locality": check_locality,
    "milp_coefficients": check_milp_coefficients,
}
ALLTOALL_ONLY = {"locality", "milp_coefficients"}


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CHECKS)), data=st.data())
def test_every_kernel_on_many_cases(name: str, data: st.DataObject) -> None:
    """The checks above on many more cases, big shapes (EP 16 and 64) included."""
    shapes = SHAPES + (BIG_SHAPES[:1] if name == "milp_coefficients" else BIG_SHAPES)
    dispatchers = ("alltoall",) if name in ALLTOALL_ONLY else ("alltoall", "deepep")
    CHECKS[name](data.draw(cases(shapes=shapes, dispatchers=dispatchers)))


# ------------------------------------------------------------------------- NVLink domains > node
@pytest.mark.parametrize("dispatcher", ["alltoall", "deepep"])
@pytest.mark.parametrize(("nodes", "gpn", "domain"), [(2, 4, 8), (4, 2, 4), (4, 4, 16)])
def test_a_domain_of_several_nodes_is_priced_as_one_big_node(
    nodes: int, gpn: int, domain: int, dispatcher: str
) -> None:
    """``cluster.nvl_domain`` spanning several nodes: every link load and per-GPU second of the cost model
    (per-source estimate and exact routes) equals that of a cluster whose nodes are the domains, and the
    kernels' checks above hold on it; across domains traffic takes the NICs, inside a domain none does."""
    case = make_case(nodes, gpn, dispatcher, 7, nvl_domain=domain)
    c = case.cost.cluster
    assert (c.num_domains, c.domain_gpus) == (nodes * gpn // domain, domain)
    flat = CostModel(ClusterSpec(c.num_domains, domain, HW, dispatcher=dispatcher), case.cost.model)
    for assign in (case.home_assign(), case.split):
        np.testing.assert_array_equal(
            case.cost.moe_comm_time(case.load, assign), flat.moe_comm_time(case.load, assign)
        )
    rng = np.random.default_rng(3)
    dest = rng.integers(0, c.num_gpus, size=(64, TOP_K))
    src = rng.integers(0, c.num_gpus, size=64)
    np.testing.assert_array_equal(case.cost.route_comm_time(dest, src), flat.route_comm_time(dest, src))
    links = fabric_links(case, case.home_assign())  # [Mb, 8, G]
    if c.num_domains == 1:
        assert not links[:, [2, 3, 6, 7]].any(), "a single NVLink domain sends nothing over the NICs"
    for check in (check_annealer_links, check_annealer_comm_time, check_annealer_swaps, check_greedy):
        check(case)
    if dispatcher == "alltoall":
        check_locality(case)
        check_milp_coefficients(case)


@pytest.mark.parametrize("name", ["annealer_comm_time", "greedy", "locality", "milp_coefficients"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "deepep"])
def test_kernels_price_fp8_dispatch_as_the_cost_model(name: str, dispatcher: str) -> None:
    """FP8 dispatch (one byte per value plus scales, combine bf16): each kernel prices each phase at its
    own bytes per token, as the cost model does."""
    if dispatcher == "deepep" and name in ALLTOALL_ONLY:
        pytest.skip("the check is alltoall's")
    for shape in ((2, 4), (4, 2), (2, 8)):
        case = make_case(*shape, dispatcher, 0)
        cost = CostModel(case.cost.cluster, case.cost.model, dispatch_value_bytes=1 + 4 / 128)
        CHECKS[name](replace(case, cost=cost))

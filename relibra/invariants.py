"""The shared plan invariant checker (docs/spine.md, "Plan invariants").

Every planner's :class:`~relibra.types.BatchPlan` and every ``plans.npz`` must satisfy:

* shapes and dtypes as documented (int32 everywhere; GPU ids in ``[0, G)``);
* ``load`` is the bincount of the per-sample counts under ``sample_gpu`` / ``sample_mb``;
* ``assign >= 0`` and token conservation ``sum_g assign[m, l, e, :] == sum_j load[m, l, :, e]``;
* without redundant slots: each GPU is home to exactly ``E / G`` experts per layer and computes at most
  ``replica_slots`` distinct non-home experts per (micro-batch, layer);
* with redundant slots: each GPU computes at most ``E / G + redundant_slots + replica_slots`` distinct
  experts per (micro-batch, layer), and when the plan lists ``redundant`` its homes plus copies fit its
  ``E / G + redundant_slots`` physical slots;
* optionally (ReLibra's layer-shared buffer): every non-home copy outside a redundant slot, and every listed
  replica, is in the node of the expert's home;
* for an online planner's plan (``BatchPlan.online``, UltraEP, LLEP): ``critical_path_s`` [Mb, L] finite and
  >= 0; where it plans to a per-GPU token capacity (LLEP's memory bound), every GPU computes at most that many
  tokens per (micro-batch, layer) unless the plan names it as loaded past it (:func:`check_token_capacity`);
  a plan whose copies sit in no fixed slots (``online.fixed_slots`` False: LLEP allocates foreign weights per
  transfer) is checked with ``replica_slots=None`` (no slot count);
* when the plan lists its slot contents (``replicas`` [Mb, L, G, r], ``redundant`` [L, G, R]): at most
  ``replica_slots`` replica slots per GPU, expert ids in ``[-1, E)``, a GPU's replica slots name an expert
  at most once and never one of its own home experts, and every non-home expert a GPU computes sits in one of
  that GPU's slots.

Each violation raises :class:`PlanInvariantError` naming the invariant (its ``.invariant``, also the
bracketed prefix of the message), the first offending index and what would be right. The checks are small
public functions (:func:`check_shapes`, :func:`check_home`, :func:`check_counts`,
:func:`check_replica_table`, :func:`check_redundant_table`) composed by :func:`check_assignment`; the torch
executor's stricter refusal (:mod:`relibra.executors.plan_check`) is built on the same functions.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from relibra.planners.protocols import BatchContext
from relibra.types import BatchPlan

__all__ = [
    "PlanInvariantError",
    "check_assignment",
    "check_counts",
    "check_home",
    "check_plan",
    "check_redundant_table",
    "check_replica_table",
    "check_shapes",
    "check_token_capacity",
    "first_index",
    "sample_loads",
]


class PlanInvariantError(ValueError):
    """A plan breaks one of the invariants of docs/spine.md, "Plan invariants".

    ``invariant`` is the violated invariant's name (the bracketed prefix of the message), ``detail`` the rest:
    the first offending index and what would be right.
    """

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"[{invariant}] {detail}")
        self.invariant = invariant
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: keeps the error picklable across processes (the default would call cls(message)).
        return (type(self), (self.invariant, self.detail))


def _fail(invariant: str, detail: str) -> NoReturn:
    raise PlanInvariantError(invariant, detail)


def _check_array(name: str, arr: Any, shape: tuple[int, ...] | None, ndim: int, where: str) -> np.ndarray:
    a = np.asarray(arr)
    if a.dtype != np.int32:
        _fail("dtype", f"{where}: {name} has dtype {a.dtype}; expected int32")
    if a.ndim != ndim:
        _fail("shape", f"{where}: {name} has shape {a.shape}; expected {ndim} dimensions")
    if shape is not None and a.shape != shape:
        _fail("shape", f"{where}: {name} has shape {a.shape}; expected {shape}")
    return a


def first_index(mask: np.ndarray) -> tuple[int, ...]:
    """Index of the first True entry of ``mask`` (row-major), as plain ints."""
    return tuple(int(i) for i in np.argwhere(mask)[0])


_first = first_index


def sample_loads(
    counts: np.ndarray, sample_gpu: np.ndarray, sample_mb: np.ndarray, num_microbatches: int, num_gpus: int
) -> np.ndarray:
    """Loads ``x[m, l, j, e]``: the bincount of per-sample counts under a sample layout.

    counts [S, L, E], sample_gpu [S], sample_mb [S] -> int64 [M, L, G, E].
    Computed here independently of the workload module so the checker does not trust the code it checks.
    """
    counts = np.asarray(counts)
    s, l, e = counts.shape
    key = np.asarray(sample_mb, dtype=np.int64) * num_gpus + np.asarray(sample_gpu, dtype=np.int64)
    out = np.zeros((num_microbatches * num_gpus, l, e), dtype=np.int64)
    if s:
        order = np.argsort(key, kind="stable")
        keys = key[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        sums = np.add.reduceat(counts[order].astype(np.int64), starts, axis=0)
        out[keys[starts]] = sums
    # [M * G, L, E] -> [M, L, G, E]
    return out.reshape(num_microbatches, num_gpus, l, e).transpose(0, 2, 1, 3)


# ------------------------------------------------------------------------------- shared invariants
def check_shapes(
    home: np.ndarray, assign: np.ndarray, load: np.ndarray, *, gpus_per_node: int, where: str = "plan"
) -> tuple[int, int, int, int]:
    """``[dtype]`` / ``[shape]``: int32 home [L, E], assign [Mb, L, E, G], load [Mb, L, G, E] that agree,
    ``G`` a multiple of ``gpus_per_node`` and ``E`` divisible by ``G``. Returns ``(Mb, L, E, G)``."""
    assign = np.asarray(assign)
    if assign.ndim != 4:
        _fail("shape", f"{where}: assign has shape {assign.shape}; expected [Mb, L, E, G]")
    mb, num_layers, num_experts, num_gpus = assign.shape
    _check_array("home", home, (num_layers, num_experts), 2, where)
    _check_array("assign", assign, None, 4, where)
    _check_array("load", load, (mb, num_layers, num_gpus, num_experts), 4, where)
    if num_gpus % gpus_per_node != 0:
        _fail("shape", f"{where}: G={num_gpus} GPUs is not a multiple of gpus_per_node={gpus_per_node}")
    if num_experts % num_gpus != 0:
        _fail("shape", f"{where}: E={num_experts} experts is not divisible by G={num_gpus} GPUs")
    return mb, num_layers, num_experts, num_gpus


def check_home(home: np.ndarray, num_gpus: int, *, balanced: bool, where: str = "plan") -> None:
    """``[home range]``: home [L, E] GPU ids in ``[0, G)``; ``[home balance]`` (when ``balanced``): every GPU
    is home to exactly ``E / G`` experts of every layer."""
    home = np.asarray(home)
    bad = (home < 0) | (home >= num_gpus)
    if bad.any():
        l, e = _first(bad)
        _fail("home range", f"{where}: home[{l}, {e}]={home[l, e]} is outside [0, {num_gpus})")
    if not balanced:
        return
    per_gpu = home.shape[1] // num_gpus
    homes_per_gpu = (home[:, :, None] == np.arange(num_gpus)).sum(axis=1)  # [L, G]
    bad = homes_per_gpu != per_gpu
    if bad.any():
        l, g = _first(bad)
        _fail(
            "home balance",
            f"{where}: GPU {g} is home to {homes_per_gpu[l, g]} experts in layer {l}; "
            f"expected exactly E/G = {per_gpu}",
        )


def check_counts(assign: np.ndarray, load: np.ndarray, where: str = "plan") -> None:
    """``[load >= 0]``, ``[assign >= 0]`` and ``[token conservation]``:
    ``sum_g assign[m, l, e, :] == sum_j load[m, l, :, e]``. assign [Mb, L, E, G], load [Mb, L, G, E]."""
    assign = np.asarray(assign)
    load = np.asarray(load)
    if (load < 0).any():
        idx = _first(load < 0)
        _fail("load >= 0", f"{where}: load{idx}={load[idx]} is negative; token counts must be >= 0")
    if (assign < 0).any():
        idx = _first(assign < 0)
        _fail("assign >= 0", f"{where}: assign{idx}={assign[idx]} is negative; token counts must be >= 0")
    want = load.sum(axis=2, dtype=np.int64)  # [Mb, L, E]
    got = assign.sum(axis=3, dtype=np.int64)  # [Mb, L, E]
    if not np.array_equal(want, got):
        m, l, e = _first(want != got)
        _fail(
            "token conservation",
            f"{where}: sum_g assign[{m}, {l}, {e}, :]={got[m, l, e]} but sum_j load[{m}, {l}, :, {e}]="
            f"{want[m, l, e]}; every routed token must be computed exactly once",
        )


def _check_slot_range(slots: np.ndarray, num_experts: int, name: str, where: str) -> None:
    bad = (slots < -1) | (slots >= num_experts)
    if bad.any():
        idx = _first(bad)
        _fail("slot range", f"{where}: {name}{idx}={slots[idx]} is outside [-1, {num_experts})")


def check_replica_table(
    replicas: np.ndarray,
    home: np.ndarray,
    num_microbatches: int,
    num_gpus: int,
    *,
    replica_slots: int | None,
    gpus_per_node: int,
    in_home_node: bool,
    where: str = "plan",
) -> np.ndarray:
    """Check the listed replica slots replicas [Mb, L, G, r] (expert per slot, -1 empty) against home [L, E].

    ``[shape]``; ``[slot capacity]`` r <= ``replica_slots`` (None: no fixed slots); ``[slot range]`` ids
    in ``[-1, E)``;
    ``[slot duplicate]`` a GPU's slots of one (micro-batch, layer) name an expert at most once and never one
    of that GPU's own home experts; ``[replicas in home node]`` (when ``in_home_node``) every listed replica
    sits in the node of its expert's home. Returns held bool [Mb, L, E, G]: expert e sits in a slot of g.
    """
    rep = np.asarray(replicas)
    num_layers, num_experts = home.shape
    if rep.ndim != 4 or rep.shape[:3] != (num_microbatches, num_layers, num_gpus):
        _fail(
            "shape",
            f"{where}: replicas has shape {rep.shape}; "
            f"expected [{num_microbatches}, {num_layers}, {num_gpus}, r]",
        )
    if replica_slots is not None and rep.shape[3] > replica_slots:
        _fail(
            "slot capacity",
            f"{where}: replicas has {rep.shape[3]} slots per GPU; at most replica_slots={replica_slots}",
        )
    _check_slot_range(rep, num_experts, "replicas", where)
    if rep.shape[3] > 1:
        srt = np.sort(rep, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        if dup.any():
            idx = _first(dup.any(axis=-1))
            _fail("slot duplicate", f"{where}: replicas{idx} holds an expert twice: {rep[idx].tolist()}")
    m, l, g, s = np.nonzero(rep >= 0)
    e = rep[m, l, g, s]
    own = home[l, e] == g
    if own.any():
        i = int(np.argmax(own))
        _fail(
            "slot duplicate",
            f"{where}: replicas[{m[i]}, {l[i]}, {g[i]}, {s[i]}] = expert {e[i]} whose home is that same GPU; "
            "a replica slot must hold a non-home expert",
        )
    if in_home_node:
        far = home[l, e] // gpus_per_node != g // gpus_per_node
        if far.any():
            i = int(np.argmax(far))
            _fail(
                "replicas in home node",
                f"{where}: replicas[{m[i]}, {l[i]}, {g[i]}, {s[i]}] = expert {e[i]} on node "
                f"{g[i] // gpus_per_node}, but its home GPU {home[l[i], e[i]]} is on node "
                f"{home[l[i], e[i]] // gpus_per_node}; replicas must stay in the home node",
            )
    held = np.zeros((num_microbatches, num_layers, num_experts, num_gpus), dtype=bool)
    held[m, l, e, g] = True
    return held


def check_redundant_table(
    redundant: np.ndarray, home: np.ndarray, num_gpus: int, *, redundant_slots: int, where: str = "plan"
) -> np.ndarray:
    """Check the permanent redundant slots redundant [L, G, R] (expert per slot, -1 empty).

    ``[shape]``; ``[slot range]``; ``[redundant slots]``: homes plus listed copies of a GPU fit its
    ``E / G + redundant_slots`` physical slots (the width R itself may exceed ``redundant_slots`` when a
    GPU is home to fewer than ``E / G`` experts). A copy of a GPU's own home expert, or one listed twice, is
    allowed (EPLB may pack two physical copies of one expert on one GPU; they compute as one).
    Returns held bool [L, E, G].
    """
    red = np.asarray(redundant)
    num_layers, num_experts = home.shape
    if red.ndim != 3 or red.shape[:2] != (num_layers, num_gpus):
        _fail("shape", f"{where}: redundant has shape {red.shape}; expected [{num_layers}, {num_gpus}, R]")
    _check_slot_range(red, num_experts, "redundant", where)
    per_gpu = num_experts // num_gpus
    physical = (home[:, :, None] == np.arange(num_gpus)).sum(axis=1) + (red >= 0).sum(axis=-1)  # [L, G]
    bad = physical > per_gpu + redundant_slots
    if bad.any():
        l, g = _first(bad)
        _fail(
            "redundant slots",
            f"{where}: GPU {g} holds {physical[l, g]} experts (homes + redundant copies) in layer {l}; "
            f"at most E/G + redundant_slots = {per_gpu + redundant_slots}",
        )
    held = np.zeros((num_layers, num_experts, num_gpus), dtype=bool)
    li, gi, si = np.nonzero(red >= 0)
    held[li, red[li, gi, si], gi] = True
    return held


def check_assignment(
    home: np.ndarray,
    assign: np.ndarray,
    load: np.ndarray,
    *,
    gpus_per_node: int,
    replica_slots: int | None,
    redundant_slots: int = 0,
    replicas_in_home_node: bool = True,
    replicas: np.ndarray | None = None,
    redundant: np.ndarray | None = None,
    require_home_balance: bool | None = None,
    require_slots: bool = False,
    where: str = "plan",
) -> None:
    """Check one batch's placement and assignments (every invariant that needs no per-sample counts).

    home [L, E], assign [Mb, L, E, G], load [Mb, L, G, E], replicas [Mb, L, G, r] or None,
    redundant [L, G, R] or None. ``replica_slots`` None: the method has no fixed slots (LLEP), so only the
    listed slot contents bound its copies. ``require_home_balance``: None checks ``[home balance]`` only
    without redundant slots (EPLB's ``home`` names one copy of each expert). ``require_slots``: every non-home
    expert a GPU computes must sit in one of its listed slots even when the plan lists none (an executor
    holds no other copies). Raises :class:`PlanInvariantError`.
    """
    home = np.asarray(home)
    assign = np.asarray(assign)
    load = np.asarray(load)
    mb, num_layers, num_experts, num_gpus = check_shapes(
        home, assign, load, gpus_per_node=gpus_per_node, where=where
    )
    if (replica_slots is not None and replica_slots < 0) or redundant_slots < 0:
        _fail(
            "slots", f"{where}: replica_slots={replica_slots}, redundant_slots={redundant_slots}; need >= 0"
        )
    balanced = redundant_slots == 0 if require_home_balance is None else require_home_balance
    check_home(home, num_gpus, balanced=balanced, where=where)
    check_counts(assign, load, where)

    held = np.zeros((mb, num_layers, num_experts, num_gpus), dtype=bool)
    in_redundant = np.zeros((num_layers, num_experts, num_gpus), dtype=bool)
    if replicas is not None:
        held |= check_replica_table(
            replicas,
            home,
            mb,
            num_gpus,
            replica_slots=replica_slots,
            gpus_per_node=gpus_per_node,
            in_home_node=replicas_in_home_node,
            where=where,
        )
    if redundant is not None:
        in_redundant = check_redundant_table(
            redundant, home, num_gpus, redundant_slots=redundant_slots, where=where
        )
        held |= in_redundant[None]

    gpus = np.arange(num_gpus)
    is_home = home[:, :, None] == gpus  # [L, E, G]
    computed = assign > 0  # [Mb, L, E, G]
    non_home = computed & ~is_home[None]
    per_gpu = num_experts // num_gpus
    if redundant_slots == 0 and replica_slots is not None:
        n_rep = non_home.sum(axis=2)  # [Mb, L, G]
        bad = n_rep > replica_slots
        if bad.any():
            m, l, g = _first(bad)
            _fail(
                "replica slots",
                f"{where}: GPU {g} computes {n_rep[m, l, g]} non-home experts in micro-batch {m}, layer {l}; "
                f"at most replica_slots={replica_slots}",
            )
    elif redundant_slots > 0:
        n_exp = computed.sum(axis=2)
        limit = per_gpu + redundant_slots + (replica_slots or 0)
        bad = n_exp > limit
        if bad.any():
            m, l, g = _first(bad)
            _fail(
                "redundant slots",
                f"{where}: GPU {g} computes {n_exp[m, l, g]} distinct experts in micro-batch {m}, layer {l}; "
                f"at most E/G + redundant_slots + replica_slots = {limit}",
            )

    if replicas_in_home_node:
        # Copies held in a permanent redundant slot may sit anywhere; the others are replicas.
        home_node = home // gpus_per_node  # [L, E]
        off_node = non_home & ~in_redundant[None] & (home_node[None, :, :, None] != gpus // gpus_per_node)
        if off_node.any():
            m, l, e, g = _first(off_node)
            _fail(
                "replicas in home node",
                f"{where}: expert {e} (home GPU {home[l, e]}) is computed on GPU {g} of another node in "
                f"micro-batch {m}, layer {l}; replicas must stay in the home node",
            )

    if replicas is not None or redundant is not None or require_slots:
        missing = non_home & ~held
        if missing.any():
            m, l, e, g = _first(missing)
            _fail(
                "slot contents",
                f"{where}: GPU {g} computes {assign[m, l, e, g]} tokens of non-home expert {e} (home GPU "
                f"{home[l, e]}) in micro-batch {m}, layer {l} but holds it in none of its replica or "
                "redundant slots",
            )


def check_plan(
    plan: BatchPlan,
    ctx: BatchContext,
    *,
    replica_slots: int | None,
    redundant_slots: int = 0,
    replicas_in_home_node: bool = True,
) -> None:
    """Assert every invariant of one batch plan against the context it was planned from.

    Raises :class:`PlanInvariantError` naming the first violated invariant.
    """
    where = f"batch {ctx.batch}"
    g = ctx.num_gpus
    sb = int(np.asarray(ctx.sample_mb).shape[0])
    mb = ctx.num_microbatches
    sample_gpu = _check_array("sample_gpu", plan.sample_gpu, (sb,), 1, where)
    bad = (sample_gpu < 0) | (sample_gpu >= g)
    if bad.any():
        (s,) = _first(bad)
        _fail("sample_gpu range", f"{where}: sample_gpu[{s}]={sample_gpu[s]} is outside [0, {g})")
    num_layers, num_experts = ctx.counts.shape[1:]
    _check_array("load", plan.load, (mb, num_layers, g, num_experts), 4, where)
    _check_array("assign", plan.assign, (mb, num_layers, num_experts, g), 4, where)
    expected = sample_loads(ctx.counts, sample_gpu, ctx.sample_mb, mb, g)
    if not np.array_equal(expected, plan.load):
        m, l, j, e = _first(expected != plan.load)
        _fail(
            "load",
            f"{where}: load[{m}, {l}, {j}, {e}]={plan.load[m, l, j, e]} but the counts under the plan's "
            f"sample_gpu / sample_mb give {expected[m, l, j, e]}",
        )
    if not (plan.plan_time_s >= 0.0):
        _fail("plan_time_s", f"{where}: plan_time_s={plan.plan_time_s}; expected a time >= 0")
    if plan.online is not None and not plan.online.fixed_slots:
        replica_slots = None  # NOTE: foreign weights allocated per transfer (LLEP): no slot count applies.
    check_assignment(
        plan.home,
        plan.assign,
        plan.load,
        gpus_per_node=ctx.cluster.domain_gpus,
        replica_slots=replica_slots,
        redundant_slots=redundant_slots,
        replicas_in_home_node=replicas_in_home_node,
        replicas=plan.replicas,
        redundant=plan.redundant,
        where=where,
    )
    if plan.online is not None:
        crit = np.asarray(plan.online.critical_path_s)
        if crit.shape != (mb, num_layers) or not np.all(np.isfinite(crit)) or (crit < 0).any():
            _fail(
                "critical path",
                f"{where}: online.critical_path_s has shape {crit.shape} (expected [{mb}, {num_layers}]) "
                "and must hold finite seconds >= 0",
            )
        if plan.online.token_capacity is not None:
            check_token_capacity(plan.assign, plan.online.token_capacity, plan.online.over_capacity, where)


def check_token_capacity(
    assign: np.ndarray, capacity: np.ndarray, over_capacity: np.ndarray | None = None, where: str = "plan"
) -> None:
    """``[token capacity]``: every GPU computes at most ``capacity[m, l]`` tokens in each (micro-batch,
    layer), except the GPUs ``over_capacity`` names. assign [Mb, L, E, G], capacity int [Mb, L],
    over_capacity bool [Mb, L, G] or None (LLEP: its memory bound, and the GPUs that took a forced spill)."""
    tokens = np.asarray(assign, dtype=np.int64).sum(axis=2)  # [Mb, L, G]
    cap = np.asarray(capacity, dtype=np.int64)
    if cap.shape != tokens.shape[:2] or (cap < 1).any():
        _fail(
            "token capacity",
            f"{where}: capacity has shape {cap.shape}; expected {tokens.shape[:2]} of ints >= 1",
        )
    bad = tokens > cap[..., None]
    if over_capacity is not None:
        bad &= ~np.asarray(over_capacity, dtype=bool)
    if bad.any():
        m, l, g = _first(bad)
        _fail(
            "token capacity",
            f"{where}: GPU {g} computes {tokens[m, l, g]} tokens in micro-batch {m}, layer {l}, above the "
            f"capacity {cap[m, l]} the plan is bound by, and the plan does not name it as over capacity",
        )

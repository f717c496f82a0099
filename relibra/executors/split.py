"""The integer split rule: how many of each source GPU's tokens of an expert each of its copies computes.

``BatchPlan.assign[m, l, e, :]`` says how many tokens of expert ``e`` each GPU computes (its home copy,
replica or redundant slots); ``load[m, l, j, e]`` how many of them source GPU ``j`` holds. An executor has
to send whole tokens, so for every (micro-batch, layer, expert) it needs an integer matrix
``n[j, g]`` (source ``j``, copy ``g``) with

* row sums the source loads: ``sum_g n[j, g] == x[j] = load[j, e]`` (every routed slot goes somewhere);
* column sums the plan's per-copy totals: ``sum_j n[j, g] == a[g] = assign[e, g]`` (each copy computes
  exactly what the plan says);
* entries close to the proportional split the cost model prices, ``p[j, g] = x[j] * a[g] / A`` with
  ``A = sum_g a[g] = sum_j x[j]``.

This is matrix rounding with fixed margins (a transportation problem on 0/1 capacities). The rule:

1. **floors**: ``n = floor(p)``, computed exactly in integers (``x * a // A``), and its remainders
   ``rem = (x * a) mod A``; the row deficits ``x[j] - sum_g n[j, g]`` and column deficits
   ``a[g] - sum_j n[j, g]`` are what is left to place, at most one token per entry with ``rem > 0``;
2. **largest remainder per source**: each source ``j`` gives one extra token each to its copies with the
   largest remainders, ties to the lower GPU id (the row sums are now exact);
3. **column fix-up**: while some copy ``g`` gets more than ``a[g]`` and another less, move one extra token
   along the shortest alternating path (breadth-first, lowest ids first) from an over-full copy to an
   under-full one: a source that holds an extra token at the over-full copy gives it up and takes one at
   a copy where it holds none yet and ``rem > 0``; repeated until every column is exact. Each move keeps
   the row sums and lowers the total column excess by one.

Guarantee: every entry is ``floor(p[j, g])`` or ``ceil(p[j, g])`` (so ``|n - p| < 1``, and ``n == p``
wherever ``p`` is an integer, in particular ``n == 0`` wherever ``x[j] == 0`` or ``a[g] == 0``), and both
margins are exact. Such a rounding always exists (the fractional parts ``rem / A`` are a feasible
fractional solution of the 0/1 transportation problem, and its integer polytope has integral vertices),
and step 3 always finds a path while a column is off: the difference between the current extras and an
exact rounding decomposes into alternating paths that start at over-full copies and end at under-full
ones. The result is deterministic: every rank computes the same matrix from the same ``load`` and
``assign``.

Slots are then taken in token order by :func:`relibra.executors.torch_moe.dispatch_counts` and the
Megatron adapter's router: the first ``n[j, 0]`` of source ``j``'s tokens of ``e`` go to GPU 0, the next
``n[j, 1]`` to GPU 1, and so on.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from relibra.invariants import PlanInvariantError

__all__ = ["split_counts"]


def _integer_array(values: np.ndarray, name: str) -> np.ndarray:
    """int64 copy of ``values``, refusing non-integer or negative entries (naming ``name``)."""
    arr = np.asarray(values)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise PlanInvariantError("integer split", f"{name} has dtype {arr.dtype}; expected integer counts")
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise PlanInvariantError(
                "integer split",
                f"{name}{list(idx)} = {float(arr[idx])} is not a whole number of tokens; the split rule "
                "needs integer per-copy totals",
            )
    out = arr.astype(np.int64)
    if (out < 0).any():
        idx = tuple(int(i) for i in np.argwhere(out < 0)[0])
        raise PlanInvariantError("integer split", f"{name}{list(idx)} = {int(out[idx])} is negative")
    return out


def split_counts(load: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """The integer split rule (module doc) of one (micro-batch, layer).

    load [G(j), E] (tokens of source ``j`` routed to ``e``), assign [E, G(g)] (tokens of ``e`` computed on
    ``g``; integers with ``sum_g assign[e, :] == sum_j load[:, e]``) -> int64 [G(j), E, G(g)] whose sum
    over ``g`` is ``load`` and over ``j`` is ``assign``, every entry the floor or ceiling of
    ``load[j, e] * assign[e, g] / sum_g assign[e, :]``.

    Raises :class:`~relibra.invariants.PlanInvariantError` (a ``ValueError``) naming the array and index
    when an entry is negative or not a whole number, the shapes disagree, or an expert's ``assign`` does
    not sum to its load.
    """
    x = _integer_array(load, "load")
    a = _integer_array(assign, "assign")
    if x.ndim != 2 or a.ndim != 2 or a.shape[0] != x.shape[1]:
        raise PlanInvariantError(
            "integer split",
            f"load has shape {x.shape} and assign {a.shape}; expected load [G, E] and assign [E, G]",
        )
    total = x.sum(axis=0)  # [E]
    wrong = np.flatnonzero(a.sum(axis=1) != total)
    if wrong.size:
        e = int(wrong[0])
        raise PlanInvariantError(
            "token conservation",
            f"assign[{e}, :] sums to {int(a[e].sum())} tokens but load[:, {e}] holds {int(total[e])}; the "
            "plan's per-copy totals must split exactly the expert's routed tokens",
        )
    # Step 1: floors and remainders of the proportional shares, exactly in integers.
    num = x[:, :, None] * a[None]  # [J, E, G]
    denom = np.maximum(total, 1)[None, :, None]  # [1, E, 1]; an expert without tokens has num == 0
    base, rem = num // denom, num % denom
    # Step 2: each source's left-over tokens to its largest remainders, ties to the lower GPU id.
    short = x - base.sum(axis=-1)  # [J, E]
    order = np.argsort(-rem, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(a.shape[1]), order.shape), axis=-1)
    extra = (rank < short[..., None]).astype(np.int64)  # [J, E, G], only where rem > 0 (short < #rem > 0)
    # Step 3: exact columns.
    excess = extra.sum(axis=0) - (a - base.sum(axis=0))  # [E, G]
    for off in np.flatnonzero((excess != 0).any(axis=1)):
        _fix_columns(extra[:, off], rem[:, off] > 0, excess[off].copy())
    return base + extra


@njit(cache=True)
def _fix_columns(extra, allowed, excess):  # pragma: no cover - compiled
    """Make one expert's extra-token columns exact (module doc, step 3), in place.

    extra int64 [J, G] (0/1, row sums already exact), allowed bool [J, G] (``rem > 0``), excess int64 [G]
    (column sums minus their targets; sums to 0). Breadth-first from every over-full column at once, in
    ascending order: column ``g`` reaches row ``j`` if ``extra[j, g] == 1``; row ``j`` reaches column
    ``h`` if ``extra[j, h] == 0`` and ``allowed[j, h]``. The first under-full column reached ends the path.
    """
    num_src, num_copies = extra.shape
    col_from_row = np.empty(num_src, dtype=np.int64)  # column a row was reached from
    row_from_col = np.empty(num_copies, dtype=np.int64)  # row a column was reached from (-1: a root)
    queue = np.empty(num_copies, dtype=np.int64)
    while True:
        has_over = False
        for g in range(num_copies):
            if excess[g] > 0:
                has_over = True
        if not has_over:
            return
        col_from_row[:] = -2
        row_from_col[:] = -2
        head, tail = 0, 0
        for g in range(num_copies):
            if excess[g] > 0:
                row_from_col[g] = -1
                queue[tail] = g
                tail += 1
        end = -1
        while head < tail and end < 0:
            g = queue[head]
            head += 1
            for j in range(num_src):
                if extra[j, g] != 1 or col_from_row[j] != -2:
                    continue
                col_from_row[j] = g
                for h in range(num_copies):
                    if extra[j, h] != 0 or not allowed[j, h] or row_from_col[h] != -2:
                        continue
                    row_from_col[h] = j
                    if excess[h] < 0:
                        end = h
                        break
                    queue[tail] = h
                    tail += 1
                if end >= 0:
                    break
        if end < 0:
            raise RuntimeError("integer split: no alternating path to an under-full copy")
        excess[end] += 1
        h = end
        while row_from_col[h] != -1:
            j = row_from_col[h]
            g = col_from_row[j]
            extra[j, h] = 1
            extra[j, g] = 0
            h = g
        excess[h] -= 1

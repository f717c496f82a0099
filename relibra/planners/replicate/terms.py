"""What the greedy replication and the exact MILP share: the cost model linearised in token equivalents,
and the rounding of a fractional token split to whole tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cost.model import CostModel

__all__ = ["ReplicationCoefficients", "round_assign"]


@dataclass(frozen=True)
class ReplicationCoefficients:
    """The linearised cost model in token equivalents (compute seconds per token = 1)."""

    fixed_tokens: float
    """Token equivalents charged per expert copy a GPU computes (``compute_s_per_expert / per_token``)."""
    nvlink_per_token: float
    """Token equivalents per token crossing one NVLink direction in one combine phase."""
    nic_per_token: float
    """Token equivalents per token crossing one rail NIC direction in one combine phase."""
    latency: float
    """Token equivalents of the four all-to-all phases' fixed latency (a constant of the objective)."""
    seconds_per_token: float
    """Compute seconds per token: multiply token equivalents by this to get seconds."""
    dispatch_scale: float = 1.0
    """A dispatch phase's per-token coefficients over a combine phase's (dispatch bytes per token over the
    combine's bf16: 1, or about 0.52 for FP8 dispatch with its scales)."""

    @staticmethod
    def from_cost(cost: CostModel) -> ReplicationCoefficients:
        lin = cost.linear()
        c = lin.compute_s_per_token
        lat = cost.cluster.hardware.alltoall_latency_s if cost.cluster.num_gpus > 1 else 0.0
        return ReplicationCoefficients(
            fixed_tokens=lin.compute_s_per_expert / c,
            nvlink_per_token=lin.nvlink_combine_s_per_token / c,
            nic_per_token=lin.rdma_combine_s_per_token / c,
            latency=4.0 * lat / c,
            seconds_per_token=c,
            dispatch_scale=lin.nvlink_dispatch_s_per_token / lin.nvlink_combine_s_per_token,
        )


def round_assign(assign: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Round a fractional split to integers with exact per-expert totals (largest remainder).

    assign float [..., E, G] (non-negative), totals int [..., E] -> int64 [..., E, G] with
    ``out.sum(-1) == totals``. Positions holding nothing (``assign == 0``) never receive a token.
    """
    a = np.maximum(np.asarray(assign, dtype=np.float64), 0.0)
    tot = np.asarray(totals, dtype=np.int64)
    scale = np.divide(tot, a.sum(axis=-1), out=np.zeros(tot.shape), where=a.sum(axis=-1) > 0)
    a = a * scale[..., None]  # NOTE: removes solver drift so that the remainders add up to an integer.
    floor = np.floor(a)
    out = floor.astype(np.int64)
    rest = tot - out.sum(axis=-1)  # [..., E], in [0, G)
    frac = np.where(a > 0, a - floor, -1.0)
    rank = np.argsort(np.argsort(-frac, axis=-1, kind="stable"), axis=-1, kind="stable")
    return out + (rank < rest[..., None])

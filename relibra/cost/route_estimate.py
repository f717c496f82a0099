"""How far the load-based DeepEP estimate is from exact per-token routes (``python -m experiments.validate``).

:func:`relibra.cost.fabric.deepep_link_tokens_estimate` sees only per-source loads ``x[j, e]`` (what
per-sample counts give); :func:`relibra.cost.fabric.deepep_link_tokens` counts each token's node and GPU set
exactly. For routes ``experts[T, L, k]`` with samples laid out round-robin over the EP group's GPUs and a
placement ``home[E]``, :func:`estimate_error` compares, per layer, the busiest GPU's DeepEP dispatch
phase (the quantity the cost model charges) of both.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from relibra.cost.fabric import deepep_link_tokens, deepep_link_tokens_estimate
from relibra.cost.model import CostModel

__all__ = ["estimate_error"]


def estimate_error(
    experts: np.ndarray, token_gpu: np.ndarray, home: np.ndarray, cost: CostModel, name: str
) -> pd.DataFrame:
    """One row per layer: exact and estimated busiest dispatch seconds and their ratio.

    experts int [T, L, k] (distinct experts per token), token_gpu int [T] (source GPU of each token),
    home int [E] (GPU of each expert). ``cost`` gives the cluster, the dispatcher's link rates and bytes.
    """
    c = cost.cluster
    g, e = c.num_gpus, home.shape[0]
    share = np.eye(g)[home]  # [E, G]
    tokens = np.bincount(token_gpu, minlength=g).astype(np.float64)
    rows = []
    for layer in range(experts.shape[1]):
        ex = experts[:, layer, :].astype(np.int64)
        exact = deepep_link_tokens(home[ex], token_gpu, c.num_domains, c.domain_gpus)
        load = np.zeros((g, e))
        np.add.at(load, (np.repeat(token_gpu, ex.shape[1]), ex.ravel()), 1.0)
        est = deepep_link_tokens_estimate(load, share, tokens, c.num_domains, c.domain_gpus)
        t_exact = float(cost.deepep_phase_times(exact)[0].max())
        t_est = float(cost.deepep_phase_times(est)[0].max())
        rows.append(
            {
                "routes": name,
                "layer": layer,
                "exact_s": t_exact,
                "estimate_s": t_est,
                "ratio": t_est / t_exact if t_exact > 0 else float("nan"),
                "rdma_ratio": est["nic_send"].sum() / max(exact["nic_send"].sum(), 1e-30),
                "nvlink_ratio": est["nvlink_recv"].sum() / max(exact["nvlink_recv"].sum(), 1e-30),
            }
        )
    return pd.DataFrame(rows)

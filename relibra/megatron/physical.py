"""The physical expert map the Megatron adapter gives the dispatcher: ``E / G`` home rows then ``r``
replica slots per rank, ``phy2log`` / ``log2phy`` and the per-(micro-batch, layer) slot table (the
glossary and a worked example are in :mod:`relibra.megatron.adapter`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PhysicalExpertMap:
    """How ``E`` logical experts, ``G`` ranks and ``r`` replica slots map onto Megatron's physical experts."""

    num_experts: int
    num_gpus: int
    replica_slots: int

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.num_experts % self.num_gpus:
            raise ValueError(
                f"num_experts={self.num_experts} must be a multiple of num_gpus={self.num_gpus} (>= 1)"
            )
        if self.replica_slots < 0:
            raise ValueError(f"replica_slots={self.replica_slots}; expected >= 0")

    @property
    def experts_per_gpu(self) -> int:
        """Home rows per rank (``E / G``)."""
        return self.num_experts // self.num_gpus

    @property
    def slots_per_gpu(self) -> int:
        """Physical experts per rank (``E / G + r``)."""
        return self.experts_per_gpu + self.replica_slots

    @property
    def num_physical(self) -> int:
        """Physical experts Megatron's dispatcher sees (``E + G * r``)."""
        return self.num_gpus * self.slots_per_gpu

    def home_id(self, gpu: np.ndarray | int, row: np.ndarray | int) -> np.ndarray | int:
        return gpu * self.slots_per_gpu + row

    def replica_id(self, gpu: np.ndarray | int, slot: np.ndarray | int) -> np.ndarray | int:
        return gpu * self.slots_per_gpu + self.experts_per_gpu + slot

    def static_phy2log(self, num_layers: int) -> np.ndarray:
        """Megatron's contiguous placement: int64 [L, G, E / G] with ``phy2log[l, g, i] = g * E / G + i``."""
        per_gpu = np.arange(self.num_experts, dtype=np.int64).reshape(self.num_gpus, self.experts_per_gpu)
        return np.broadcast_to(per_gpu, (num_layers, *per_gpu.shape)).copy()


def log2phy(expert_map: PhysicalExpertMap, phy2log: np.ndarray) -> np.ndarray:
    """phy2log [L, G, E / G] -> int64 [L, E]: physical id of each expert's home row."""
    num_layers, g, n = phy2log.shape
    out = np.empty((num_layers, expert_map.num_experts), dtype=np.int64)
    ids = np.asarray(expert_map.home_id(np.arange(g)[:, None], np.arange(n)[None, :]))  # [G, n]
    np.put_along_axis(
        out, phy2log.reshape(num_layers, -1), np.broadcast_to(ids.reshape(-1), (num_layers, g * n)), 1
    )
    return out


def next_phy2log(phy2log: np.ndarray, new_home: np.ndarray) -> np.ndarray:
    """Home rows after moving to placement new_home [L, E]: unmoved experts keep their rows, freed rows
    (ascending) take the incoming experts (ascending). phy2log [L, G, n] -> int64 [L, G, n]."""
    num_layers, g, n = phy2log.shape
    counts = np.stack([(new_home == gpu).sum(axis=1) for gpu in range(g)], axis=1)  # [L, G]
    if (counts != n).any():
        layer, gpu = np.argwhere(counts != n)[0]
        raise ValueError(
            f"new home: layer {layer} puts {counts[layer, gpu]} experts on rank {gpu}; expected E / G = {n}"
        )
    out = np.array(phy2log, dtype=np.int64, copy=True)
    for layer in range(num_layers):
        for gpu in range(g):
            stays = new_home[layer, out[layer, gpu]] == gpu  # [n]
            incoming = np.setdiff1d(np.flatnonzero(new_home[layer] == gpu), out[layer, gpu][stays])
            out[layer, gpu, np.flatnonzero(~stays)] = incoming
    return out


def slot_table(
    expert_map: PhysicalExpertMap,
    home_phys: np.ndarray,
    home: np.ndarray,
    replicas: np.ndarray | None,
    split: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Where one source rank's tokens of each expert go, for one (micro-batch, layer).

    home_phys [E] (``log2phy[l]``), home [E] (home rank), replicas [G, r] (-1 empty) or None, split [E, G]
    (this source's row of :func:`relibra.executors.split.split_counts`) -> ``phys`` int64 [E, G] (physical
    id of ``e``'s copy on rank ``g``) and ``bound`` int64 [E, G] (``cumsum(split, axis=1)``: the copy of a
    token is the number of bounds its rank among ``e``'s tokens reaches).
    """
    e_total, g_total = split.shape
    phys = np.broadcast_to(np.asarray(home_phys, dtype=np.int64)[:, None], (e_total, g_total)).copy()
    if replicas is not None:
        gpu, slot = np.nonzero(replicas >= 0)
        phys[replicas[gpu, slot], gpu] = expert_map.replica_id(gpu, slot)
    held = np.asarray(home)[:, None] == np.arange(g_total)
    if replicas is not None:
        held[replicas[gpu, slot], gpu] = True
    bad = (split > 0) & ~held
    if bad.any():
        e, g = np.argwhere(bad)[0]
        raise ValueError(
            f"the plan sends {split[e, g]} tokens of expert {e} to rank {g}, which is neither its home "
            f"({home[e]}) nor holds a replica of it; assign and replicas must agree"
        )
    return phys, np.cumsum(split, axis=1).astype(np.int64)

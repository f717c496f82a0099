"""The analytical cost model of the simulated executor (docs/spine.md, "Cost model").

Per (micro-batch, layer): ``T_MoE = max_g T_comp(g) + max_g T_comm(g)``.

* Compute: every GPU runs one grouped GEMM over the experts it computes. An expert with ``n`` tokens costs
  ``max(flops(n) / (peak * eff(n)), bytes_read / hbm)`` with ``eff(n) = gemm_efficiency * n / (n + n_half)``
  (small per-expert token counts are inefficient), forward plus backward (backward = 2x forward FLOPs).
  ``cluster.hardware.gemm_model=tiled`` prices each GPU's kernels in padded tiles and whole waves over its
  SMs instead (:mod:`relibra.cost.grouped_gemm`), and ``per_expert_costs`` adds what grows with the experts a
  GPU hosts; both are off by default.
* Communication: dispatch (source ``j`` -> computing GPU ``g``) and combine (``g`` -> ``j``), forward and
  backward, on a rail-optimized fabric. Each source splits its tokens for expert ``e`` over ``e``'s copies in
  proportion to ``assign[e, :]`` (the proportional split rule). Same GPU: free. Same node: NVLink.
  Other node, same rail: the rail NIC (RDMA). Other node, other rail: an NVLink hop to the source node's GPU
  on the destination rail, then RDMA. ``T_comm(g)`` is the busiest link class (send or receive) of ``g``.
  What crosses depends on ``cluster.dispatcher`` (:mod:`relibra.cost.fabric`): ``alltoall`` sends one row per
  (token, expert) pair; ``deepep`` sends a token once per remote node over RDMA and once per GPU over
  NVLink. Achievable link rates are line rate times the calibrated efficiencies (docs/validation.md).

All functions broadcast over leading axes, so one call covers a whole batch ``[Mb, L, ...]``.

A calibration file (optional) replaces the roofline curve of :meth:`CostModel.expert_time` with a measured
one (:mod:`relibra.cost.calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.calibration import check_calibration
from relibra.cost.fabric import (
    alltoall_traffic,
    deepep_link_tokens,
    deepep_link_tokens_estimate,
    mirrored,
    rail_link_bytes,
)
from relibra.cost.grouped_gemm import (
    GEMM_CALLS_PER_EXPERT,
    ROUTING_MAP_BYTES_PER_ENTRY,
    TiledGemm,
    per_expert_seconds,
)
from relibra.cost.migration import MigrationPayload
from relibra.cost.step import TrainingSpec, WholeStepTerms
from relibra.parallel import ParallelDims

BF16_BYTES = 2
FP8_DISPATCH_VALUE_BYTES = 1.0 + 4.0 / 128
"""FP8 dispatch (DeepEP, Hybrid-EP): one byte per value plus one fp32 scale per 128 values."""
FWD_BWD_FLOP_FACTOR = 3.0
"""Forward (1x) plus backward (2x: input and weight gradients)."""
WEIGHT_READS_FWD_BWD = 3.0
"""Weights are read once per pass: forward, input-gradient and weight-gradient GEMMs."""


@dataclass(frozen=True)
class LinearCosts:
    """Linearised coefficients for planners that build LP / MILP / annealing objectives."""

    compute_s_per_token: float
    """Marginal compute seconds per token of one expert (large-count regime, fwd + bwd)."""
    compute_s_per_expert: float
    """Fixed compute seconds per expert a GPU computes (the small-count loss, fwd + bwd)."""
    nvlink_s_per_token: float
    """Seconds per token crossing one NVLink direction, summed over the 4 all-to-all phases."""
    rdma_s_per_token: float
    """Seconds per token crossing one rail NIC direction, summed over the 4 all-to-all phases."""
    nvlink_dispatch_s_per_token: float
    """Seconds per token crossing one NVLink direction in one dispatch phase."""
    rdma_dispatch_s_per_token: float
    """Seconds per token crossing one rail NIC direction in one dispatch phase."""
    nvlink_combine_s_per_token: float
    """Seconds per token crossing one NVLink direction in one combine phase."""
    rdma_combine_s_per_token: float
    """Seconds per token crossing one rail NIC direction in one combine phase."""


@dataclass(frozen=True)
class MoEBreakdown:
    """Named cost terms of the MoE part of (micro-batch, layer) problems, leading axes ``[...]``."""

    t_compute_gpu: np.ndarray
    """float64 [..., G]: grouped-GEMM seconds of each GPU (fwd + bwd)."""
    t_comm_gpu: np.ndarray
    """float64 [..., G]: all-to-all seconds of each GPU (busiest link class, 4 phases)."""

    @property
    def t_compute(self) -> np.ndarray:
        """float64 [...]: ``max_g T_comp(g)``."""
        return self.t_compute_gpu.max(axis=-1)

    @property
    def t_comm(self) -> np.ndarray:
        """float64 [...]: ``max_g T_comm(g)``."""
        return self.t_comm_gpu.max(axis=-1)

    @property
    def t_moe(self) -> np.ndarray:
        """float64 [...]: ``T_MoE = max_g T_comp + max_g T_comm``."""
        return self.t_compute + self.t_comm


class CostModel(WholeStepTerms):
    """Analytical (roofline) cost model; a calibration table may replace the expert GEMM curve.

    The whole step's terms beyond the MoE layers (:class:`relibra.cost.step.WholeStepTerms`) are methods
    too; they need ``training``.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        calibration: tuple[np.ndarray, np.ndarray] | None = None,
        dispatch_value_bytes: float | None = None,
        training: TrainingSpec | None = None,
        migration: MigrationPayload | None = None,
        parallel: ParallelDims | None = None,
    ) -> None:
        """``calibration``: (tokens [P] increasing, seconds [P]) of one expert's fwd+bwd grouped GEMM.

        ``dispatch_value_bytes``: bytes per hidden value in the dispatch phases; default by
        ``cluster.precision``: bf16 2, fp8 :data:`FP8_DISPATCH_VALUE_BYTES` (one scale per 128 values);
        combine is always bf16. ``training``: how the step around the MoE layers runs (None: the MoE-only
        step, no training terms; :mod:`relibra.cost.pricing` then charges none of them).
        ``migration``: what a re-homed expert carries and how (default: :class:`MigrationPayload`'s
        defaults); the simulator and the planners price moves with it (:mod:`relibra.cost.migration`).
        ``parallel``: the parallel dimensions around the EP group (default: EP only, :mod:`relibra.parallel`);
        tensor parallelism needs ``tp`` to divide ``cluster.gpus_per_node`` (its groups ride one node's
        NVLink).
        """
        self.cluster = cluster
        self.dispatcher = cluster.dispatcher
        self.model = model
        self.training = training
        if calibration is not None:
            calibration = check_calibration(calibration, model.name)
        self.calibration = calibration
        self.migration = migration if migration is not None else MigrationPayload()
        self.parallel = parallel if parallel is not None else ParallelDims()
        if cluster.gpus_per_node % self.parallel.tp:
            raise ValueError(
                f"parallel.tp={self.parallel.tp} does not divide cluster.gpus_per_node="
                f"{cluster.gpus_per_node}: "
                "a tensor-parallel group rides one node's NVLink"
            )
        hw = cluster.hardware
        if calibration is not None and hw.gemm_model == "tiled":
            raise ValueError(
                "cluster.calibration with cluster.hardware.gemm_model=tiled: both replace the expert GEMM "
                "curve; give one (gemm_model=smooth reads the calibration table)"
            )
        fp8 = cluster.precision == "fp8"
        if dispatch_value_bytes is None:
            dispatch_value_bytes = FP8_DISPATCH_VALUE_BYTES if fp8 else BF16_BYTES
        self._w = float(model.expert_params)
        self._peak = hw.fp8_flops * hw.fp8_gemm_efficiency if fp8 else hw.bf16_flops * hw.gemm_efficiency
        self._weight_bytes = 1.0 if fp8 else float(BF16_BYTES)
        self._token_bytes = float(model.hidden * BF16_BYTES)
        self.dispatch_token_bytes = float(model.hidden * dispatch_value_bytes)
        self._nvlink = hw.nvlink_bytes_per_s * hw.nvlink_efficiency
        self._nic = hw.nic_bytes_per_s * hw.nic_efficiency
        gpn = cluster.domain_gpus
        g = np.arange(cluster.num_gpus)
        self._same_node = (g[:, None] // gpn) == (g[None, :] // gpn)
        self._same_gpu = g[:, None] == g[None, :]

    # ------------------------------------------------------------------ compute
    def expert_time(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds of one expert's fwd+bwd GEMMs for ``tokens`` tokens (same shape; 0 tokens -> 0 s)."""
        n = np.asarray(tokens, dtype=np.float64)
        return np.where(n > 0, self._busy_expert_time(n), 0.0)

    def _busy_expert_time(self, n: np.ndarray) -> np.ndarray:
        """:meth:`expert_time` where ``n`` > 0 (other entries: any value)."""
        if self.calibration is not None:
            xs, ys = self.calibration
            t = np.interp(n, xs, ys, left=ys[0], right=np.nan)
            over = n > xs[-1]
            if np.any(over):  # NOTE: beyond the table, extrapolate with its last slope.
                slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
                t = np.where(over, ys[-1] + slope * (n - xs[-1]), t)
        else:
            hw = self.cluster.hardware
            flops = 2.0 * self._w * n * FWD_BWD_FLOP_FACTOR
            t_flops = flops * (n + hw.gemm_half_tokens) / np.maximum(n, 1e-30) / self._peak
            t_mem = WEIGHT_READS_FWD_BWD * self._w * self._weight_bytes / hw.hbm_bytes_per_s
            t = np.maximum(t_flops, t_mem)
        return t

    def gpu_compute_time(self, assign: np.ndarray) -> np.ndarray:
        """``assign`` [..., E, G] tokens of expert e computed on GPU g -> seconds [..., G].

        ``cluster.hardware.gemm_model``: ``smooth`` (the default) is bit for bit
        ``expert_time(assign).sum(axis=-2)`` (tests/cost/test_cost.py); ``tiled`` prices each GPU's grouped
        GEMMs in tiles and waves over all its experts at once
        (:meth:`relibra.cost.grouped_gemm.TiledGemm.gpu_seconds`).
        ``cluster.hardware.per_expert_costs`` adds the per-expert GEMM launches (:meth:`expert_launch_time`).
        """
        hw = self.cluster.hardware
        if hw.gemm_model == "tiled":
            t = self._tiled().gpu_seconds(assign)
        else:
            t = self._smooth_gpu_time(assign)
        if hw.per_expert_costs:
            t = t + self.expert_launch_time(assign)
        return t

    def compute_floor(self, per_expert: np.ndarray, num_gpus: int) -> np.ndarray:
        """Seconds [...]: no plan's busiest GPU computes the experts' tokens ``per_expert`` [..., E] over
        ``num_gpus`` GPUs in less (the ``balanced`` bound's compute). ``smooth``: each expert's tokens in one
        GEMM, split evenly, ``expert_time(per_expert).sum(-1) / G`` (splitting an expert never costs less on
        the smooth curve); ``tiled``: :meth:`relibra.cost.grouped_gemm.TiledGemm.floor_seconds`; with
        ``per_expert_costs`` every expert with tokens launches its GEMMs at least once, ``1 / G`` of them
        each.
        """
        hw = self.cluster.hardware
        n = np.asarray(per_expert)
        if hw.gemm_model == "tiled":
            t = self._tiled().floor_seconds(n, num_gpus)
        else:
            t = self.expert_time(n).sum(axis=-1) / num_gpus
        if hw.per_expert_costs:
            busy = (n > 0).sum(axis=-1)
            t = t + busy * (GEMM_CALLS_PER_EXPERT * hw.expert_launch_s) / num_gpus
        return np.asarray(t)

    def _tiled(self) -> TiledGemm:
        """The tiled grouped GEMMs of this model's experts on this hardware (``gemm_model: tiled``)."""
        hw, m = self.cluster.hardware, self.model
        return TiledGemm(
            m.hidden, m.moe_ffn, hw.gemm_tile_m, hw.gemm_tile_n, hw.sms, self._peak,
            hw.hbm_bytes_per_s / self._weight_bytes,
        )  # fmt: skip

    def expert_launch_time(self, assign: np.ndarray) -> np.ndarray:
        """Host seconds [..., G] of each GPU's per-expert GEMM launches, fwd + bwd, for assign [..., E, G]
        (:func:`relibra.cost.grouped_gemm.per_expert_seconds`; 0 unless ``per_expert_costs``)."""
        hw = self.cluster.hardware
        if not hw.per_expert_costs:
            return np.zeros(np.shape(assign)[:-2] + np.shape(assign)[-1:])
        return per_expert_seconds(assign, hw.expert_launch_s, 0.0)[0]

    def routing_map_time(self, assign: np.ndarray) -> np.ndarray:
        """Seconds [..., G] of the flex (DeepEP) dispatcher's receive-side routing map over each GPU's hosted
        experts, fwd + bwd, for assign [..., E, G]
        (:data:`relibra.cost.grouped_gemm.ROUTING_MAP_BYTES_PER_ENTRY` per received slot and hosted expert,
        HBM-bound; 0 unless ``per_expert_costs`` with ``deepep``)."""
        hw = self.cluster.hardware
        if not hw.per_expert_costs or self.dispatcher != "deepep":
            return np.zeros(np.shape(assign)[:-2] + np.shape(assign)[-1:])
        per_entry = ROUTING_MAP_BYTES_PER_ENTRY / self.hbm_rate()
        return per_expert_seconds(assign, 0.0, per_entry)[1]

    def _smooth_gpu_time(self, assign: np.ndarray) -> np.ndarray:
        """The smooth curve summed per GPU, bit for bit ``expert_time(assign).sum(axis=-2)``.

        A plan's ``assign`` is mostly zeros (an expert computes on its home GPU and a few replicas), so only
        the busy entries are priced and summed, each GPU's in the order of ``e`` as numpy's reduction over
        ``E`` adds them (zeros add nothing), instead of every entry of the dense array.
        """
        a = np.asarray(assign, dtype=np.float64)
        lead, (num_experts, num_gpus) = a.shape[:-2], a.shape[-2:]
        busy = np.flatnonzero(a > 0)
        out = np.bincount(
            (busy // (num_experts * num_gpus)) * num_gpus + busy % num_gpus,
            weights=self._busy_expert_time(a.ravel()[busy]),
            minlength=int(np.prod(lead, dtype=np.int64)) * num_gpus,
        )
        return out.reshape(*lead, num_gpus)

    # ------------------------------------------------------------ communication
    @staticmethod
    def share(assign: np.ndarray) -> np.ndarray:
        """Fraction of expert e's tokens computed on GPU g: assign [..., E, G] -> float64 [..., E, G]."""
        a = np.asarray(assign, dtype=np.float64)
        tot = a.sum(axis=-1, keepdims=True)
        return np.divide(a, tot, out=np.zeros_like(a), where=tot > 0)

    def traffic(self, load: np.ndarray, assign: np.ndarray) -> np.ndarray:
        """Tokens sent from source ``j`` to computing GPU ``g`` under the proportional split rule.

        load [..., G, E] (``x[j, e]``), assign [..., E, G] -> traffic float64 [..., G(j), G(g)].
        """
        return np.asarray(load, dtype=np.float64) @ self.share(assign)

    def link_bytes(self, traffic_bytes: np.ndarray) -> dict[str, np.ndarray]:
        """Per-GPU bytes on each link class for a one-way exchange ``traffic_bytes`` [..., G(j), G(g)].

        Returns ``nvlink_send``, ``nvlink_recv``, ``nic_send``, ``nic_recv``, each [..., G]
        (:func:`relibra.cost.fabric.rail_link_bytes`).
        """
        return rail_link_bytes(traffic_bytes, self.cluster.num_domains, self.cluster.domain_gpus)

    def _phase_time(self, links: dict[str, np.ndarray], bytes_per_token: float) -> np.ndarray:
        """Seconds [..., G] of one all-to-all phase: the busiest link direction of each GPU."""
        t_nvl = np.maximum(links["nvlink_send"], links["nvlink_recv"]) * bytes_per_token / self._nvlink
        t_nic = np.maximum(links["nic_send"], links["nic_recv"]) * bytes_per_token / self._nic
        return np.maximum(t_nvl, t_nic)

    def _four_phases(self, dispatch: np.ndarray, combine: np.ndarray) -> np.ndarray:
        """Forward and backward of dispatch and combine (phase seconds [..., G] each) plus the latency."""
        lat = self.cluster.hardware.alltoall_latency_s if self.cluster.num_gpus > 1 else 0.0
        return 2.0 * (dispatch + combine) + 4.0 * lat

    def comm_time(self, traffic_tokens: np.ndarray) -> np.ndarray:
        """Per-GPU all-to-all seconds [..., G] for ``alltoall`` token traffic [..., G(j), G(g)], 4 phases.

        Dispatch and combine, forward and backward. The dispatch phases use ``traffic``, the combine phases
        its transpose; a phase's time on a GPU is its busiest link direction, and every phase pays the
        all-to-all latency. Dispatch moves :attr:`dispatch_token_bytes` per token, combine ``hidden`` bf16.
        """
        tt = np.asarray(traffic_tokens, dtype=np.float64)
        dispatch = self._phase_time(self.link_bytes(tt), self.dispatch_token_bytes)
        combine = self._phase_time(self.link_bytes(np.swapaxes(tt, -1, -2)), self._token_bytes)
        return self._four_phases(dispatch, combine)

    def deepep_comm_time(self, links: dict[str, np.ndarray]) -> np.ndarray:
        """Per-GPU seconds [..., G] of DeepEP's 4 phases for dispatch token counts ``links``
        (:data:`relibra.cost.fabric.LINK_KEYS`); combine mirrors dispatch (send and receive swapped)."""
        return self._four_phases(*self.deepep_phase_times(links))

    def deepep_phase_times(self, links: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(dispatch, combine) seconds [..., G] of one DeepEP pass for dispatch token counts ``links``."""
        return (
            self._phase_time(links, self.dispatch_token_bytes),
            self._phase_time(mirrored(links), self._token_bytes),
        )

    def moe_comm_time(self, load: np.ndarray, assign: np.ndarray) -> np.ndarray:
        """Per-GPU all-to-all seconds [..., G] of load [..., G, E] under assign [..., E, G], by dispatcher.

        ``alltoall``: :meth:`traffic` then :meth:`comm_time`. ``deepep``: the per-source estimate
        :func:`relibra.cost.fabric.deepep_link_tokens_estimate` (each source holds ``sum_e x[j, e] / k``
        tokens, every token having ``k`` distinct experts) then :meth:`deepep_comm_time`.
        """
        if self.dispatcher == "alltoall":
            return self.comm_time(self.traffic(load, assign))
        x = np.asarray(load, dtype=np.float64)
        links = deepep_link_tokens_estimate(
            x,
            self.share(assign),
            x.sum(axis=-1) / self.model.top_k,
            self.cluster.num_domains,
            self.cluster.domain_gpus,
        )
        return self.deepep_comm_time(links)

    def route_comm_time(self, dest_gpu: np.ndarray, src_gpu: np.ndarray) -> np.ndarray:
        """Per-GPU seconds [G] of one (micro-batch, layer) from exact per-token routes, by dispatcher.

        dest_gpu int [T, k] (GPU computing each of a token's experts), src_gpu int [T].
        """
        c = self.cluster
        if self.dispatcher == "alltoall":
            return self.comm_time(alltoall_traffic(dest_gpu, src_gpu, c.num_gpus))
        return self.deepep_comm_time(deepep_link_tokens(dest_gpu, src_gpu, c.num_domains, c.domain_gpus))

    # --------------------------------------------------------------------- MoE
    def moe(self, load: np.ndarray, assign: np.ndarray) -> MoEBreakdown:
        """Breakdown for load [..., G, E] and assign [..., E, G]."""
        return MoEBreakdown(
            t_compute_gpu=self.gpu_compute_time(assign),
            t_comm_gpu=self.moe_comm_time(load, assign),
        )

    def linear(self) -> LinearCosts:
        """Linearised coefficients of the roofline (valid for counts well above ``gemm_half_tokens``)."""
        hw = self.cluster.hardware
        per_tok = 2.0 * self._w * FWD_BWD_FLOP_FACTOR / self._peak
        return LinearCosts(
            compute_s_per_token=per_tok,
            compute_s_per_expert=per_tok * hw.gemm_half_tokens,
            nvlink_s_per_token=2.0 * (self.dispatch_token_bytes + self._token_bytes) / self._nvlink,
            rdma_s_per_token=2.0 * (self.dispatch_token_bytes + self._token_bytes) / self._nic,
            nvlink_dispatch_s_per_token=self.dispatch_token_bytes / self._nvlink,
            rdma_dispatch_s_per_token=self.dispatch_token_bytes / self._nic,
            nvlink_combine_s_per_token=self._token_bytes / self._nvlink,
            rdma_combine_s_per_token=self._token_bytes / self._nic,
        )

    # ---------------------------------------------------------------- attention
    def attention_time(self, tokens: np.ndarray, causal_pairs: np.ndarray) -> np.ndarray:
        """Per-GPU seconds of one layer's attention and dense projections, fwd + bwd.

        tokens [..., G] and causal_pairs [..., G] (attention pairs per layer, :mod:`relibra.attention_span`).
        Includes the shared experts, if the model has any, since they are dense per token. The projections
        and shared experts run at the dense peak of ``cluster.precision``, the core attention (QK^T, PV) in
        bf16 (FlashAttention), each at ``attention_efficiency``.
        """
        m = self.model
        proj = 2.0 * m.attention_params * np.asarray(tokens, dtype=np.float64)
        shared = 2.0 * 3 * m.hidden * m.shared_ffn * m.shared_experts * np.asarray(tokens, dtype=np.float64)
        attn = m.core_attention_flops(causal_pairs)  # QK^T and PV (ModelSpec.core_attention_flops)
        if self.cluster.precision == "bf16":  # NOTE: one sum, so bf16 results keep their former rounding.
            return FWD_BWD_FLOP_FACTOR * (proj + shared + attn) / self.dense_rate("bf16")
        return FWD_BWD_FLOP_FACTOR * ((proj + shared) / self.dense_rate() + attn / self.dense_rate("bf16"))

    def shared_expert_time(self, tokens: np.ndarray) -> np.ndarray:
        """Per-GPU seconds of one MoE layer's shared experts (a part of :meth:`attention_time`), fwd + bwd;
        tokens [..., G] -> [..., G]. Zero without shared experts."""
        m = self.model
        flops = 2.0 * 3 * m.hidden * m.shared_ffn * m.shared_experts * np.asarray(tokens, dtype=np.float64)
        return FWD_BWD_FLOP_FACTOR * flops / self.dense_rate()

    def mla_up_time(self, tokens: np.ndarray) -> np.ndarray:
        """Per-GPU seconds of one layer's MLA up projections (a part of :meth:`attention_time`), fwd + bwd;
        tokens [..., G] -> [..., G]. Zero without MLA (:meth:`ModelSpec.mla_up_flops`)."""
        return FWD_BWD_FLOP_FACTOR * self.model.mla_up_flops(tokens) / self.dense_rate()

    def dense_ffn_time(self, tokens: np.ndarray) -> np.ndarray:
        """Per-GPU seconds of one dense (non-MoE) layer's FFN, fwd + bwd; tokens [..., G] -> [..., G].

        Zero when the model has no dense FFN (``dense_ffn == 0``).
        """
        m = self.model
        flops = 2.0 * 3 * m.hidden * m.dense_ffn * np.asarray(tokens, dtype=np.float64)
        return FWD_BWD_FLOP_FACTOR * flops / self.dense_rate()

    # ------------------------------------------------------------ replica buffer
    def expert_weight_bytes(self) -> float:
        """Bytes of one expert's bf16 weights (one replica slot)."""
        return self._w * BF16_BYTES

    def refill_time(self, replicas_per_gpu: np.ndarray) -> np.ndarray:
        """Seconds to fill the layer-shared replica slots over NVLink; replicas_per_gpu [..., G] -> [...].

        Each GPU receives its replicas from GPUs of its own node; the receive side bounds the copy. The same
        bytes flow back as replica gradients in backward, so callers charge this twice (fwd and bwd).
        """
        recv = np.asarray(replicas_per_gpu, dtype=np.float64) * self.expert_weight_bytes()
        return recv.max(axis=-1) / self._nvlink

    def replica_refill_time(self, replicas: np.ndarray, home: np.ndarray) -> np.ndarray:
        """Seconds to fill the replica slots over NVLink, bounded by the busier of sender and receiver.

        replicas int [..., L, G, r] (expert in each slot, -1 empty), home int [L, E] -> float64 [..., L].
        A slot is filled from the expert's home GPU; a hot expert replicated on several peers makes its
        home the bottleneck sender. One direction (the forward fill); backward sends the same bytes home.
        """
        rep = np.asarray(replicas)
        home = np.asarray(home)
        g = rep.shape[-2]
        filled = rep >= 0
        recv = filled.sum(axis=-1).astype(np.float64)  # [..., L, G]
        lidx = np.broadcast_to(np.arange(home.shape[0])[:, None, None], rep.shape)
        src = np.where(filled, home[lidx, np.maximum(rep, 0)], g)  # [..., L, G, r]; g = none
        rows = int(np.prod(src.shape[:-2]))
        key = np.arange(rows)[:, None] * (g + 1) + src.reshape(rows, -1)  # one bincount for all rows
        send = np.bincount(key.ravel(), minlength=rows * (g + 1)).reshape(rows, g + 1)[:, :g]
        send = send.reshape(*rep.shape[:-1]).astype(np.float64)
        busiest = np.maximum(recv, send).max(axis=-1)
        return busiest * self.expert_weight_bytes() / self._nvlink

    @staticmethod
    def exposed_refill(refill: np.ndarray, attention: np.ndarray | float) -> np.ndarray:
        """Seconds of replica-buffer traffic that attention does not hide, per (micro-batch, layer).

        refill [...] (one direction, :meth:`replica_refill_time`) and attention [...] (fwd + bwd seconds of
        the layer's attention on the busiest GPU) broadcast together. The forward refill overlaps the
        forward attention (a third of fwd + bwd, backward being twice the forward FLOPs); the backward
        gradient reduction sends the same bytes home during the backward attention (two thirds). The closed
        form of what :func:`relibra.cost.transfers.price_transfers` charges a buffer planned before the batch
        (the simulator and the planners price through it; tests compare the two).
        """
        return CostModel.exposed_copies(refill, refill, attention)

    @staticmethod
    def exposed_copies(
        fill: np.ndarray, grad_return: np.ndarray, attention: np.ndarray | float
    ) -> np.ndarray:
        """:meth:`exposed_refill` when the backward gradient return takes other links than the forward fill
        (ForeMoE: the fill by :meth:`engine_copy_time`, the gradients home over :meth:`fabric_copy_time`).

        fill [...], grad_return [...] (seconds) and attention [...] (fwd + bwd seconds) broadcast together;
        the fill overlaps a third of the attention, the gradient return the other two thirds.
        """
        fill = np.asarray(fill, dtype=np.float64)
        grad_return = np.asarray(grad_return, dtype=np.float64)
        attention = np.asarray(attention, dtype=np.float64)
        return np.maximum(fill - attention / 3, 0) + np.maximum(grad_return - 2 * attention / 3, 0)

    def fabric_copy_time(self, replicas: np.ndarray, home: np.ndarray) -> np.ndarray:
        """Seconds to copy every listed slot's expert from its home GPU at once, on the fabric (NVLink inside
        a node; the rail NIC, after an NVLink hop when the rails differ, across nodes), bounded by the busiest
        link. For online planners whose copies may leave the node (LLEP); equal to
        :meth:`replica_refill_time` when every copy stays in its home node.

        replicas int [..., L, G, r] (expert in each slot, -1 empty), home int [L, E] -> float64 [..., L].
        """
        rep = np.asarray(replicas)
        home = np.asarray(home)
        g = rep.shape[-2]
        filled = rep >= 0
        lidx = np.broadcast_to(np.arange(home.shape[0])[:, None, None], rep.shape)
        src = home[lidx, np.maximum(rep, 0)]  # [..., L, G, r]
        dst = np.broadcast_to(np.arange(g)[:, None], rep.shape)
        rows = int(np.prod(rep.shape[:-2]))
        row = np.broadcast_to(np.arange(rows).reshape(*rep.shape[:-2], 1, 1), rep.shape)
        key = ((row * g + src) * g + dst)[filled]
        mat = np.bincount(key, minlength=rows * g * g).reshape(*rep.shape[:-2], g, g)
        lb = self.link_bytes(mat * self.expert_weight_bytes())
        t_nvl = np.maximum(lb["nvlink_send"], lb["nvlink_recv"]) / self._nvlink
        t_nic = np.maximum(lb["nic_send"], lb["nic_recv"]) / self._nic
        return np.asarray(np.maximum(t_nvl, t_nic).max(axis=-1))

    def engine_copy_time(self, replicas: np.ndarray, home: np.ndarray) -> np.ndarray:
        """Seconds to fill the listed slots with a transfer engine of two concurrent paths (ForeMoE's
        GPU-direct and CPU-assisted paths): a copy is read from host memory over the GPU's host link
        (``host_to_device_bytes_per_s``) when that link is faster than the fabric link it would otherwise take
        from its
        home (NVLink inside the NVLink domain, the rail NIC across domains), else over the fabric; the slower
        path bounds the fill. The forward fill only: the host holds the weights (reloaded after rollout, and
        constant through the step's micro-steps), not the copies' gradients, which go home over the fabric
        (:meth:`fabric_copy_time`, :meth:`exposed_copies`).

        replicas int [..., L, G, r] (expert in each slot, -1 empty), home int [L, E] -> float64 [..., L].
        """
        host_rate = self.cluster.hardware.host_to_device_bytes_per_s
        if host_rate <= 0:
            raise ValueError(
                "cluster.hardware.host_to_device_bytes_per_s=0: a host-memory transfer path needs the host "
                "link's rate"
            )
        rep = np.asarray(replicas)
        home = np.asarray(home)
        g = rep.shape[-2]
        lidx = np.broadcast_to(np.arange(home.shape[0])[:, None, None], rep.shape)
        src = home[lidx, np.maximum(rep, 0)]  # [..., L, G, r]
        dst = np.broadcast_to(np.arange(g)[:, None], rep.shape)
        d = self.cluster.domain_gpus
        direct_rate = np.where(src // d == dst // d, self._nvlink, self._nic)
        by_host = (rep >= 0) & (host_rate > direct_rate)
        direct = self.fabric_copy_time(np.where(by_host, -1, rep), home)
        host = by_host.sum(axis=-1).max(axis=-1) * self.expert_weight_bytes() / host_rate
        return np.asarray(np.maximum(direct, host))

    def transfer_time(self, src: np.ndarray, dst: np.ndarray, bytes_each: float) -> float:
        """Seconds to move one payload of ``bytes_each`` from ``src[i]`` to ``dst[i]`` for every i at once.

        Used for reordering migration (payload: weights, gradients, optimizer state) and redundant-copy sync.
        """
        g = self.cluster.num_gpus
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        if src.size == 0:
            return 0.0
        mat = np.zeros((g, g))
        np.add.at(mat, (src, dst), bytes_each)
        np.fill_diagonal(mat, 0.0)
        return float(self._phase_time(self.link_bytes(mat), 1.0).max())

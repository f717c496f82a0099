"""The expert grouped GEMMs of each GPU as a tiled kernel runs them, and the costs that grow with the
experts a GPU hosts (``cluster.hardware.gemm_model`` and ``cluster.hardware.per_expert_costs``; both opt-in).

**Tile and wave quantisation** (``gemm_model: tiled``; :meth:`TiledGemm.gpu_seconds`). One grouped GEMM is one
kernel over every expert a GPU computes, as DeepGEMM's M-grouped contiguous layout runs it
(deepseek-ai/DeepGEMM ``csrc/jit_kernels/heuristics/sm90.hpp`` and ``sm100.hpp``, ``get_layout_info``):
each expert's rows are padded to the M tile (``ceil(n / BM) * BM``; the contiguous layout aligns each
expert to ``BM``, ``heuristics/runtime.hpp`` ``kLegacyMKAlignmentForContiguousLayout = 128``), the output
is cut into ``ceil(N / BN)`` tiles per row tile, and the GPU's CTAs run in whole waves of its SM count,
``waves = ceil(tiles / SMs)`` (DeepGEMM's own ``num_waves``). A wave costs one tile's FLOPs on one SM,
``2 BM BN K`` at ``peak * efficiency / SMs``. A SwiGLU expert (``W1``: hidden -> 2 ffn, gate and up;
``W2``: ffn -> hidden) runs six such kernels per layer, fwd + bwd:

* M-grouped (rows = tokens): ``fc1`` forward (N = 2 ffn, K = hidden), ``fc2`` forward (N = hidden, K =
  ffn), ``fc2`` input gradient (N = ffn, K = hidden), ``fc1`` input gradient (N = hidden, K = 2 ffn);
* K-grouped (the weight gradients, DeepGEMM's ``KGroupedContiguous``: the tokens are the reduction): each
  expert's output tiles (``ceil(hidden / BM) * ceil(2 ffn / BN)`` for ``W1``, ``ceil(ffn / BM) *
  ceil(hidden / BN)`` for ``W2``) each reduce ``ceil(n / BM)`` chunks of ``BM`` padded rows. A CTA owns
  one output tile, so the kernel takes at least its longest tile: ``max(ceil(units / SMs), max_e
  ceil(n_e / BM))`` chunk-waves, ``units = sum_e tiles_e * ceil(n_e / BM)``.

Each kernel also reads the weights of every expert it computes once (the roofline's memory floor, as the
smooth curve of :meth:`relibra.cost.model.CostModel.expert_time`): a kernel costs ``max(waves * wave
seconds, weight bytes / HBM)``. When every expert's count is a multiple of ``BM`` and the tiles fill whole
waves, the six kernels cost exactly the expert FLOPs at ``peak * gemm_efficiency``; the smooth curve's
``gemm_half_tokens`` (a padding-like small-count loss) is therefore not added: ``tiled`` replaces it.

Choices left open: ``BN`` (DeepGEMM's SM90 heuristic picks it per shape from 16 to 256, its SM100
M-grouped layout fixes 128; Transformer Engine's default cuBLAS path lets cuBLAS pick) is the yaml's
``gemm_tile_n``; tiles of one kernel are priced as one pool over the GPU's SMs (DeepGEMM, CUTLASS
grouped GEMM, Transformer Engine with ``NVTE_USE_CUTLASS_GROUPED_GEMM``), not as Transformer Engine's
default of one cuBLAS GEMM per expert on four streams; SMs an overlapped all-to-all holds are not taken
from the pool; the reduction chunk of the weight gradients is ``BM``. Only the executed price
(:meth:`relibra.cost.model.CostModel.gpu_compute_time`) is tiled:
:meth:`~relibra.cost.model.CostModel.expert_time` and :meth:`~relibra.cost.model.CostModel.linear`,
which the planners' objectives read, keep the smooth curve; the ``balanced`` bound (``baselines/balanced.py``)
reads :meth:`~relibra.cost.model.CostModel.compute_floor`, under ``tiled`` :meth:`TiledGemm.floor_seconds`: a
mean over GPUs no placement can go below, so the bound stays a bound under either model.

Sources read at deepseek-ai/DeepGEMM ``54e2261``, NVIDIA/Megatron-LM ``d98e8a6`` and
NVIDIA/TransformerEngine ``d0067d0``.

**Per-expert costs** (``per_expert_costs: true``; :func:`per_expert_seconds`). What Megatron-core's MoE
layer does once per local expert or per (token, local expert) entry (NVIDIA/Megatron-LM
``megatron/core/transformer/moe/``, Transformer Engine ``transformer_engine/``):

* the experts' GEMMs: ``TEGroupedMLP`` runs Transformer Engine's ``GroupedLinear``, whose default path
  (``common/gemm/cublaslt_gemm.cu``, ``multi_stream_cublas_gemm``) launches one cuBLAS GEMM per local
  expert in each grouped call: :data:`GEMM_CALLS_PER_EXPERT` per layer, fwd + bwd, each
  ``expert_launch_s`` of host time that the GPU waits for after the dropless dispatcher's host sync
  (``tokens_per_expert`` to the host before the experts run);
* the receive-side permutation of the flex (DeepEP) dispatcher: ``_indices_to_multihot`` builds a dense
  ``[received tokens, local experts]`` routing map and probabilities, and the fused permutation
  (``pytorch/triton/permutation.py``, ``make_row_id_map``) scans it in three passes into a ``[tokens, 2
  local experts + 1]`` int32 row map: :data:`ROUTING_MAP_BYTES_PER_ENTRY` per (received slot, hosted
  expert), HBM-bound.

What grows with nothing a plan sets, and so is not here: the router's top-k and its ``[tokens, E]``
routing map on the source GPU (over every logical expert; :meth:`relibra.cost.step.WholeStepTerms.router_time`
prices it per token), and the all-to-all dispatcher's source-side permutation over the same map. The
all-to-all dispatcher's receive-side ``sort_chunks_by_idxs`` over ``ep * local experts`` chunks is one
fused kernel per token (``make_chunk_sort_map``), so only the GEMM launches grow with its hosted experts.
Choices left open: received slots stand for received tokens in the routing map's rows (a token with two
local experts is one row; slots are an upper bound); a hosted expert is one with tokens in the plan
(``assign > 0``), a replica included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "GEMM_CALLS_PER_EXPERT",
    "GEMM_MODELS",
    "ROUTING_MAP_BYTES_PER_ENTRY",
    "TiledGemm",
    "hosted_experts",
    "per_expert_seconds",
]

GEMM_MODELS = ("smooth", "tiled")
"""Values of ``cluster.hardware.gemm_model``: the smooth small-count curve (``gemm_half_tokens``) or tiles and
waves (module doc)."""
GEMM_CALLS_PER_EXPERT = 6
"""Per-expert GEMMs of one SwiGLU expert per layer, fwd + bwd: ``fc1`` and ``fc2`` forward, then each one's
input gradient and weight gradient (Transformer Engine ``GroupedLinear``: one cuBLAS GEMM per expert in
each of its forward, dgrad and wgrad grouped calls)."""
ROUTING_MAP_BYTES_PER_ENTRY = 1.0 + 4.0 + 8.0 + 12.0 + 8.0 + 4.0
"""HBM bytes per (received token, local expert) entry of the flex dispatcher's receive-side permutation,
fwd + bwd (Transformer Engine ``pytorch/triton/permutation.py``; Megatron-core ``token_dispatcher.py``
``_indices_to_multihot``): ``make_row_id_map`` reads the bool map (1), pass 1 writes an int32 block cumsum
(4), pass 2 reads and rewrites it (8), pass 3 reads it and writes the ``2 E + 1`` int32 row map (4 + 8);
the multihot probabilities are a dense fp32 ``[tokens, local experts]`` (8: written, then read by the
permutation); the backward writes the probabilities' dense fp32 gradient (4)."""


def hosted_experts(assign: np.ndarray) -> np.ndarray:
    """float64 [..., G]: experts (replicas included) with tokens on each GPU, from assign [..., E, G]."""
    return np.asarray((np.asarray(assign) > 0).sum(axis=-2), dtype=np.float64)


def _kernels(hidden: int, ffn: int, tile_m: int, tile_n: int) -> tuple[tuple[bool, int, int, int], ...]:
    """The six kernels of a SwiGLU expert layer (module doc), in the order they are summed: (K-grouped?,
    output tiles per padded row tile, reduction per tile, weight elements read per expert)."""
    h, f = int(hidden), int(ffn)

    def m(n_out: int, k: int) -> tuple[bool, int, int, int]:
        return False, _ceil_div(n_out, tile_n), k, n_out * k

    def kg(out_rows: int, out_cols: int) -> tuple[bool, int, int, int]:
        return True, _ceil_div(out_rows, tile_m) * _ceil_div(out_cols, tile_n), tile_m, out_rows * out_cols

    return (
        m(2 * f, h),  # fc1 forward
        m(h, f),  # fc2 forward
        m(f, h),  # fc2 input gradient
        m(h, 2 * f),  # fc1 input gradient
        kg(h, 2 * f),  # fc1 weight gradient
        kg(f, h),  # fc2 weight gradient
    )


@dataclass(frozen=True)
class TiledGemm:
    """One GPU's tiled grouped GEMMs for an expert shape (module doc): what :meth:`gpu_seconds` prices and
    :meth:`floor_seconds` bounds."""

    hidden: int
    ffn: int
    tile_m: int
    """The M tile (rows of tokens), each expert's rows padded to it."""
    tile_n: int
    """The N tile (output columns)."""
    sms: int
    flops_per_s: float
    """The GPU's achievable GEMM rate (peak times ``gemm_efficiency``), shared by its ``sms`` SMs."""
    weight_bytes_per_s: float
    """HBM bytes per second over one expert weight element's bytes (the kernels' memory floor reads
    ``params / weight_bytes_per_s`` seconds per expert weight matrix)."""

    def gpu_seconds(self, assign: np.ndarray) -> np.ndarray:
        """Seconds [..., G] of each GPU's six grouped-GEMM kernels (module doc) for assign [..., E, G].

        An M-grouped kernel runs ``ceil(row tiles * output tiles / SMs)`` waves; a K-grouped one at least its
        longest tile's reduction, ``max_e ceil(n_e / BM)`` chunk-waves.
        """
        a = np.asarray(assign, dtype=np.float64)
        row_tiles = np.ceil(
            a / self.tile_m
        )  # [..., E, G]: padded row tiles of each expert (0 without tokens)
        rows = row_tiles.sum(axis=-2)  # [..., G]
        longest = row_tiles.max(axis=-2)  # [..., G]
        busy = (a > 0).sum(axis=-2).astype(np.float64)  # [..., G]
        per_sm = self.flops_per_s / self.sms
        total = np.zeros(rows.shape)
        for k_grouped, tiles, tile_k, weights in _kernels(self.hidden, self.ffn, self.tile_m, self.tile_n):
            waves = np.ceil(rows * tiles / self.sms)
            if k_grouped:
                waves = np.maximum(waves, longest)
            compute = waves * (2.0 * self.tile_m * self.tile_n * tile_k / per_sm)
            total = total + np.maximum(compute, busy * weights / self.weight_bytes_per_s)
        return np.asarray(total)

    def floor_seconds(self, per_expert: np.ndarray, num_gpus: int) -> np.ndarray:
        """Seconds [...]: a lower bound of the busiest GPU's :meth:`gpu_seconds` under any split of the
        experts' tokens ``per_expert`` [..., E] over ``num_gpus`` GPUs.

        Splitting an expert over copies never reduces its padded row tiles (``sum_g ceil(a_g / BM) >=
        ceil(n / BM)``) nor its weight reads (each copy reads them), waves are at least ``tiles / SMs``, the
        busiest GPU at least the mean, and a mean of maxima at least the maximum of the means: each kernel is
        priced at ``max(sum_e tiles_e / (SMs G) * wave seconds, busy experts * weight bytes / (G * rate))``.
        """
        n = np.asarray(per_expert, dtype=np.float64)
        rows = np.ceil(n / self.tile_m).sum(axis=-1)  # [...]: the fewest padded row tiles of the layer
        busy = (n > 0).sum(axis=-1).astype(np.float64)
        per_sm = self.flops_per_s / self.sms
        g = float(num_gpus)
        total = np.zeros(rows.shape)
        for _, tiles, tile_k, weights in _kernels(self.hidden, self.ffn, self.tile_m, self.tile_n):
            compute = rows * tiles / (self.sms * g) * (2.0 * self.tile_m * self.tile_n * tile_k / per_sm)
            total = total + np.maximum(compute, busy * weights / (self.weight_bytes_per_s * g))
        return np.asarray(total)


def per_expert_seconds(
    assign: np.ndarray, launch_s: float, routing_map_s_per_entry: float
) -> tuple[np.ndarray, np.ndarray]:
    """(GEMM launch seconds, routing-map seconds) [..., G] of each GPU's hosted experts (module doc), fwd +
    bwd, for assign [..., E, G]: ``hosted * GEMM_CALLS_PER_EXPERT * launch_s`` and ``received * hosted *
    routing_map_s_per_entry`` (0 for a dispatcher that builds no receive-side map)."""
    a = np.asarray(assign, dtype=np.float64)
    hosted = hosted_experts(a)
    received = a.sum(axis=-2)
    return hosted * (GEMM_CALLS_PER_EXPERT * launch_s), received * hosted * routing_map_s_per_entry


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)

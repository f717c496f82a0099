"""Cluster and model shapes: the constants the cost model reads (values live in experiments/conf)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.attention_span import FULL_CAUSAL, AttentionSpan
from relibra.cost.fabric import DISPATCHER_COMM_SMS, DISPATCHERS
from relibra.cost.grouped_gemm import GEMM_MODELS

MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
""":class:`ModelSpec`'s multi-head latent attention keys: optional in a model config (0: grouped-query)."""
PRECISIONS = ("bf16", "fp8")
"""Values of ``cluster.precision``: the GEMMs' (and the dispatch's) number format."""


@dataclass(frozen=True)
class HardwareSpec:
    """Per-GPU hardware constants. Values and their sources are in ``experiments/conf/cluster/*.yaml``.

    No field but ``fp8_flops``, ``fp8_gemm_efficiency``, ``hbm_efficiency``, ``host_to_device_bytes_per_s``,
    ``hbm_bytes``, ``sms`` and the opt-in grouped-GEMM settings (``gemm_model`` onwards: smooth, off) has a
    default (0: unknown, refused where a run needs it): the rates and efficiencies are measured or derived
    per machine (the link efficiencies from DeepEP's published bandwidth tables,
    :mod:`relibra.cost.linkrates`), so the cluster yaml is the one place they are written and a hand-built
    spec states every one of them.
    """

    name: str
    bf16_flops: float
    """Dense bf16 peak, FLOP/s."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU per direction, bytes/s."""
    nic_bytes_per_s: float
    """Rail NIC bandwidth per GPU per direction, bytes/s (one NIC per GPU on its rail)."""
    gemm_efficiency: float
    """Fraction of peak a large grouped GEMM reaches."""
    gemm_half_tokens: float
    """Tokens per expert at which a grouped GEMM reaches half of ``gemm_efficiency`` (small-count loss)."""
    attention_efficiency: float
    """Fraction of peak reached by attention and dense projections."""
    alltoall_latency_s: float
    """Fixed latency of one all-to-all phase."""
    nvlink_efficiency: float
    """Achievable fraction of ``nvlink_bytes_per_s`` (the cost model's NVLink rate is the product)."""
    nic_efficiency: float
    """Achievable fraction of ``nic_bytes_per_s`` over RDMA."""
    fp8_flops: float = 0.0
    """Dense FP8 peak, FLOP/s (0: unknown; ``cluster.precision=fp8`` is then refused)."""
    fp8_gemm_efficiency: float = 0.0
    """Fraction of ``fp8_flops`` a large FP8 grouped GEMM reaches (0: unknown; ``cluster.precision=fp8`` is
    then refused)."""
    hbm_efficiency: float = 0.0
    """Achievable fraction of ``hbm_bytes_per_s`` for streaming (elementwise) kernels; the whole step's
    memory-bound terms read it (0: unknown; ``simulator.step=whole`` is then refused)."""
    host_to_device_bytes_per_s: float = 0.0
    """Achievable host-to-GPU copy rate per GPU, bytes/s (0: unknown); the ``reload`` migration path
    (``simulator.migration.path``, :mod:`relibra.cost.migration`) and ForeMoE's host path read it."""
    hbm_bytes: float = 0.0
    """HBM capacity per GPU, bytes (0: unknown; ``simulator.memory_check`` then cannot run and says so,
    :mod:`relibra.cost.memory`)."""
    host_overhead_s: float = 0.0
    """Exposed host seconds per MoE layer, pass direction and micro-batch on this GPU generation with its
    software stack (the dropless dispatcher's device-to-host sync and the launches queued after it),
    calibrated per generation on that generation's own measurements (each cluster yaml names its rows);
    what ``training.host_overhead_s`` takes when left null
    (:meth:`relibra.cost.step.WholeStepTerms.host_overhead`)."""
    sms: int = 0
    """Streaming multiprocessors per GPU (0: unknown; an overlapped all-to-all that holds SMs,
    ``cluster.comm_sms > 0`` under ``cluster.ep_overlap``, and ``gemm_model=tiled`` are then refused)."""
    gemm_model: str = "smooth"
    """How the expert grouped GEMMs are priced (:data:`relibra.cost.grouped_gemm.GEMM_MODELS`): ``smooth``
    (``gemm_half_tokens``'s curve per expert) or ``tiled`` (padded tiles and whole waves per GPU)."""
    gemm_tile_m: int = 0
    """The grouped GEMM's M tile (rows of tokens) and per-expert alignment under ``gemm_model=tiled`` (0:
    unknown; ``tiled`` is then refused)."""
    gemm_tile_n: int = 0
    """The grouped GEMM's N tile (output columns) under ``gemm_model=tiled`` (0: unknown, as
    ``gemm_tile_m``)."""
    per_expert_costs: bool = False
    """Price what grows with the experts a GPU hosts: per-expert GEMM launches and the flex dispatcher's
    receive-side routing map (:mod:`relibra.cost.grouped_gemm`)."""
    expert_launch_s: float = 0.0
    """Host seconds of one per-expert GEMM launch, read under ``per_expert_costs``."""

    def __post_init__(self) -> None:
        problems = grouped_gemm_problems(
            self.gemm_model, self.gemm_tile_m, self.gemm_tile_n, self.sms, self.per_expert_costs
        )
        launch = self.expert_launch_s
        if isinstance(launch, bool) or not isinstance(launch, int | float) or not launch >= 0:
            problems.append(f"cluster.hardware.expert_launch_s={launch!r}: must be a number >= 0")
        if problems:
            raise ValueError("; ".join(problems))


def grouped_gemm_problems(
    gemm_model: object, tile_m: object, tile_n: object, sms: object, per_expert_costs: object
) -> list[str]:
    """Why ``cluster.hardware``'s grouped-GEMM settings (:class:`HardwareSpec`, ``gemm_model`` onwards)
    cannot price a run, one line each: ``gemm_model`` one of :data:`~relibra.cost.grouped_gemm.GEMM_MODELS`,
    ``tiled`` with integer tiles and SM count >= 1, ``per_expert_costs`` a boolean (``expert_launch_s``, a
    number, is checked with the other numeric keys)."""
    problems: list[str] = []
    if gemm_model not in GEMM_MODELS:
        problems.append(f"cluster.hardware.gemm_model={gemm_model!r}: choose one of {', '.join(GEMM_MODELS)}")
    if not isinstance(per_expert_costs, bool):
        problems.append(f"cluster.hardware.per_expert_costs={per_expert_costs!r}: must be true or false")
    if gemm_model == "tiled":
        for key, value in (("gemm_tile_m", tile_m), ("gemm_tile_n", tile_n), ("sms", sms)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"cluster.hardware.{key}={value!r}: gemm_model=tiled needs an integer >= 1")
    return problems


@dataclass(frozen=True)
class ClusterSpec:
    """The EP group: ``G = nodes * gpus_per_node`` GPUs on a rail-optimized fabric."""

    nodes: int
    gpus_per_node: int
    hardware: HardwareSpec
    dispatcher: str = "alltoall"
    """How tokens travel (:mod:`relibra.cost.fabric`): ``alltoall`` (Megatron) or ``deepep``."""
    ep_overlap: bool = False
    """Hide one micro-batch's all-to-all behind another's compute (Megatron's
    ``overlap_moe_expert_parallel_comm``)."""
    nvl_domain: int | None = None
    """GPUs per NVLink domain (``cluster.nvl_domain``; None: ``gpus_per_node``, a Hopper node). A multiple of
    ``gpus_per_node``; a domain larger than the EP group holds the whole group (a rack-scale system such as
    GB200 NVL72 running EP 8-64), a smaller one must divide it (:attr:`domain_gpus`)."""
    precision: str = "bf16"
    """GEMM number format (:data:`PRECISIONS`): ``fp8`` runs the expert and dense GEMMs at the FP8 peak and
    dispatches FP8 tokens with their scales (combine stays bf16); core attention and the LM head stay bf16."""
    comm_sms: int | None = None
    """SMs the dispatch and combine kernels hold while they run (``cluster.comm_sms``; None: the
    dispatcher's, :data:`relibra.cost.fabric.DISPATCHER_COMM_SMS`). Read under ``ep_overlap`` only
    (:attr:`comm_sm_share`)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"cluster.nodes={self.nodes} and cluster.gpus_per_node={self.gpus_per_node} must both be >= 1"
            )
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"cluster.dispatcher={self.dispatcher!r}: choose one of {', '.join(DISPATCHERS)}"
            )
        problem = nvl_domain_problem(self.nodes, self.gpus_per_node, self.nvl_domain)
        if problem:
            raise ValueError(problem)
        if self.precision not in PRECISIONS:
            raise ValueError(f"cluster.precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if problem := comm_sms_problem(self.comm_sms, self.hardware.sms, self.ep_overlap, self.dispatcher):
            raise ValueError(problem)
        if self.precision == "fp8" and not (
            self.hardware.fp8_flops > 0 and self.hardware.fp8_gemm_efficiency > 0
        ):
            raise ValueError(
                "cluster.precision=fp8 needs cluster.hardware.fp8_flops and "
                f"cluster.hardware.fp8_gemm_efficiency > 0 (hardware {self.hardware.name} has "
                f"{self.hardware.fp8_flops} and {self.hardware.fp8_gemm_efficiency})"
            )

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def domain_gpus(self) -> int:
        """GPUs of the EP group in one NVLink domain: ``min(nvl_domain, G)`` (``gpus_per_node`` by default).

        The fabric (:mod:`relibra.cost.fabric`) and every planner that keeps copies close use this as the
        "node" of the rail-optimized fabric: NVLink inside it, the rail NICs between domains."""
        return min(self.nvl_domain or self.gpus_per_node, self.num_gpus)

    @property
    def comm_sm_share(self) -> float:
        """The share of each GPU's SMs the overlapped all-to-all holds (:mod:`relibra.cost.overlap`'s
        contention): ``comm_sms / hardware.sms`` under ``ep_overlap``, else 0 (nothing runs beside it)."""
        sms = held_sms(self.comm_sms, self.dispatcher)
        if not self.ep_overlap or sms == 0:
            return 0.0
        return sms / self.hardware.sms

    @property
    def num_domains(self) -> int:
        """NVLink domains the EP group spans (``G / domain_gpus``)."""
        return self.num_gpus // self.domain_gpus


def mla_problem(values: dict[str, int]) -> str | None:
    """Why the MLA keys (:data:`MLA_KEYS` -> integers) do not describe an attention, or None: the latent
    keys other than ``kv_lora_rank`` only beside ``kv_lora_rank > 0``."""
    rest = {k: v for k, v in values.items() if k != "kv_lora_rank" and v}
    if values.get("kv_lora_rank", 0) <= 0 and rest:
        listed = ", ".join(f"model.{k}={v}" for k, v in rest.items())
        return f"{listed}: multi-head latent attention keys need model.kv_lora_rank > 0"
    return None


def held_sms(comm_sms: int | None, dispatcher: str) -> int:
    """SMs the all-to-all holds: ``cluster.comm_sms``, or the dispatcher's when it is null."""
    return DISPATCHER_COMM_SMS.get(dispatcher, 0) if comm_sms is None else comm_sms


def comm_sms_problem(comm_sms: object, sms: object, ep_overlap: bool, dispatcher: str) -> str | None:
    """Why ``cluster.comm_sms`` cannot price the overlap's SM contention, or None: an integer in ``[0,
    hardware.sms)`` (null: the dispatcher's), and a known SM count when the overlapped all-to-all holds
    any."""
    if comm_sms is not None and (isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or comm_sms < 0):
        return f"cluster.comm_sms={comm_sms!r}: must be an integer >= 0 or null (the dispatcher's)"
    held = held_sms(comm_sms, dispatcher)  # type: ignore[arg-type]
    if not ep_overlap or held == 0:
        return None
    if isinstance(sms, bool) or not isinstance(sms, int) or sms <= 0:
        return (
            f"cluster.ep_overlap with {held} SMs held by the all-to-all (cluster.comm_sms) needs "
            f"cluster.hardware.sms, the GPU's SM count (got {sms!r})"
        )
    if held >= sms:
        return f"cluster.comm_sms={held}: must be below cluster.hardware.sms={sms}, the GPU's SMs"
    return None


def nvl_domain_problem(nodes: int, gpus_per_node: int, nvl_domain: int | None) -> str | None:
    """Why ``cluster.nvl_domain`` cannot describe this EP group (None: it can).

    A domain is whole nodes (a multiple of ``gpus_per_node``); when it is smaller than the EP group
    (``nodes * gpus_per_node``), the group is whole domains (the domain divides it), so that every domain
    of the fabric is alike."""
    if nvl_domain is None:
        return None
    g = nodes * gpus_per_node
    if isinstance(nvl_domain, bool) or not isinstance(nvl_domain, int) or nvl_domain < 1:
        return f"cluster.nvl_domain={nvl_domain!r}: must be an integer >= 1 (GPUs per NVLink domain) or null"
    if nvl_domain % gpus_per_node:
        return (
            f"cluster.nvl_domain={nvl_domain} is not a multiple of cluster.gpus_per_node={gpus_per_node}: "
            "an NVLink domain holds whole nodes"
        )
    if nvl_domain < g and g % nvl_domain:
        return (
            f"cluster.nvl_domain={nvl_domain} does not divide the EP group cluster.nodes * "
            f"cluster.gpus_per_node = {nodes} * {gpus_per_node} = {g}: the group must be whole NVLink "
            "domains (or lie inside one)"
        )
    return None


@dataclass(frozen=True)
class ModelSpec:
    """MoE model shape (one file per model in ``experiments/conf/model/``, each naming its source)."""

    name: str
    num_layers: int
    """Transformer layers in total."""
    num_moe_layers: int
    hidden: int
    moe_ffn: int
    """Expert FFN width."""
    num_experts: int
    top_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    shared_experts: int = 0
    shared_ffn: int = 0
    dense_ffn: int = 0
    """FFN width of the dense (non-MoE) layers, if any."""
    vocab: int = 151936
    """Vocabulary size; the input embedding and the LM head are separate matrices (untied, as in every
    model of ``experiments/conf/model``)."""
    attention_window: int | None = None
    """Keys per query on the sliding-window layers, the query included (Hugging Face ``sliding_window``);
    None: every layer attends over the whole sample."""
    windowed_layers: int = 0
    """Layers that attend inside ``attention_window`` (gpt-oss: every other layer)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (MLA, DeepSeek-V2/V3; Hugging Face ``kv_lora_rank``): the rank of the
    compressed keys and values; 0 for grouped-query attention. With MLA ``head_dim`` is the query and key
    head dimension without RoPE (``qk_nope_head_dim``) and ``num_kv_heads`` is unused."""
    q_lora_rank: int = 0
    """MLA's query compression rank (``q_lora_rank``); 0: the queries are projected from the hidden state
    directly (DeepSeek-V2-Lite)."""
    qk_rope_head_dim: int = 0
    """MLA's decoupled RoPE dimension per head (``qk_rope_head_dim``), shared by the heads for the keys."""
    v_head_dim: int = 0
    """MLA's value head dimension (``v_head_dim``); 0: ``head_dim``."""

    def __post_init__(self) -> None:
        values = {k: getattr(self, k) for k in MLA_KEYS}
        if any(v < 0 for v in values.values()):
            raise ValueError(
                "model.kv_lora_rank, q_lora_rank, qk_rope_head_dim and v_head_dim must be >= 0; got "
                + ", ".join(f"{k}={v}" for k, v in values.items())
            )
        if problem := mla_problem(values):
            raise ValueError(problem)
        if not 0 <= self.windowed_layers <= self.num_layers:
            raise ValueError(
                f"model.windowed_layers={self.windowed_layers}: expected 0 to "
                f"model.num_layers={self.num_layers}"
            )
        if self.windowed_layers and self.attention_window is None:
            raise ValueError(
                f"model.windowed_layers={self.windowed_layers} needs model.attention_window (keys per query)"
            )
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(
                f"model.attention_window={self.attention_window}: expected an integer >= 1 or null"
            )

    @property
    def attention_span(self) -> AttentionSpan:
        """The pairs each sample's attention computes (:mod:`relibra.attention_span`)."""
        if not self.windowed_layers:
            return FULL_CAUSAL
        return AttentionSpan(self.attention_window, self.windowed_layers / self.num_layers)

    @property
    def expert_params(self) -> int:
        """Parameters of one expert: gate, up and down projections (``3 * hidden * moe_ffn``)."""
        return 3 * self.hidden * self.moe_ffn

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Query and key dimension per head: ``head_dim``, plus the RoPE part with MLA."""
        return self.head_dim + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        """Value dimension per head: ``v_head_dim`` with MLA (when set), else ``head_dim``."""
        return self.v_head_dim or self.head_dim

    def attention_gemms(self) -> tuple[tuple[int, int], ...]:
        """``(input, output)`` widths per token of one layer's attention projections, in order.

        Grouped-query: the fused QKV projection ``(h, q + 2 kv)`` and the output projection ``(q, h)``.
        MLA (Megatron-core's ``MLASelfAttention``; DeepSeek-V3 technical report, section 2.1.1): the query
        down and up projections ``(h, q_lora)``, ``(q_lora, H * qk)`` (one ``(h, H * qk)`` without query
        compression), the key-value down projection ``(h, kv_lora + rope)``, its up projection ``(kv_lora,
        H * (nope + v))`` and the output projection ``(H * v, h)``. The latents' RMSNorms (``q_lora +
        kv_lora`` weights) are left out, as every other norm's weights are here.
        """
        h, heads = self.hidden, self.num_heads
        if not self.mla:
            q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
            return ((h, q + 2 * kv), (q, h))
        qk, v = heads * self.qk_head_dim, heads * self.value_head_dim
        query = ((h, self.q_lora_rank), (self.q_lora_rank, qk)) if self.q_lora_rank else ((h, qk),)
        kv_up = (self.kv_lora_rank, heads * (self.head_dim + self.value_head_dim))
        return (*query, (h, self.kv_lora_rank + self.qk_rope_head_dim), kv_up, (v, h))

    @property
    def attention_params(self) -> int:
        """Parameters of one layer's attention projections (:meth:`attention_gemms`: q, k, v, o)."""
        if not self.mla:
            q = self.num_heads * self.head_dim
            kv = self.num_kv_heads * self.head_dim
            return self.hidden * (q + 2 * kv) + q * self.hidden
        return sum(i * o for i, o in self.attention_gemms())

    def core_attention_flops(self, causal_pairs: np.ndarray) -> np.ndarray:
        """Forward FLOPs of QK^T and PV over ``causal_pairs`` [...] (attention pairs per layer): 2 FLOPs per
        (pair, head, dimension) of each, the keys' dimension ``qk_head_dim`` and the values'
        ``value_head_dim`` (both ``head_dim`` for grouped-query attention)."""
        pairs = np.asarray(causal_pairs, dtype=np.float64)
        if not self.mla:
            return 4.0 * pairs * self.num_heads * self.head_dim
        return 2.0 * pairs * self.num_heads * (self.qk_head_dim + self.value_head_dim)

    def mla_up_flops(self, tokens: np.ndarray) -> np.ndarray:
        """Forward FLOPs of MLA's two up projections (what Megatron's ``mla_up_proj`` recompute repeats)
        over ``tokens`` [...]; 0 without MLA or, for the query, without query compression."""
        t = np.asarray(tokens, dtype=np.float64)
        if not self.mla:
            return np.zeros_like(t)
        heads = self.num_heads
        up = self.kv_lora_rank * heads * (self.head_dim + self.value_head_dim)
        if self.q_lora_rank:
            up += self.q_lora_rank * heads * self.qk_head_dim
        return 2.0 * up * t

    @property
    def dense_params(self) -> int:
        """Parameters outside the routed experts: embedding and LM head, every layer's attention, norms and
        router, the shared experts and the dense layers' FFNs (:mod:`relibra.cost.step` shards them over the
        data-parallel group)."""
        norms = 2 * self.hidden * self.num_layers + self.hidden
        router = self.hidden * self.num_experts * self.num_moe_layers
        shared = 3 * self.hidden * self.shared_ffn * self.shared_experts * self.num_moe_layers
        dense = 3 * self.hidden * self.dense_ffn * (self.num_layers - self.num_moe_layers)
        return (
            2 * self.vocab * self.hidden
            + self.attention_params * self.num_layers
            + norms
            + router
            + shared
            + dense
        )

    def check_ep(self, cluster: ClusterSpec) -> None:
        """Refuse an EP group that cannot hold this model's experts evenly."""
        g = cluster.num_gpus
        if self.num_experts % g != 0:
            raise ValueError(
                f"model.num_experts={self.num_experts} is not divisible by the EP size "
                f"cluster.nodes * cluster.gpus_per_node = {cluster.nodes} * {cluster.gpus_per_node} = {g}"
            )

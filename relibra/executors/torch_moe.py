"""An expert-parallel MoE layer on ``torch.distributed`` that executes ReLibra plans with replayed routes.

One process per GPU of the EP group (rank ``g`` is GPU ``g``). Each transformer layer ``l`` of the model is
an attention stand-in (a dense local map, where the replica copy overlaps) followed by an MoE block whose
forward is cut into the stages of Megatron-LM's all-to-all token dispatcher:

1. **route**: router probabilities are computed, but the top-k expert ids are the replayed routes (as
   Megatron-core's ``RouterReplay``), never recomputed;
2. **dispatch**: every routed slot goes to the GPU that computes it, by one ``all_to_all_single``;
3. **compute**: each GPU runs its experts (home rows, replica slots, redundant slots) over its rows, grouped
   by expert;
4. **combine**: the inverse ``all_to_all_single``; each token sums its ``k`` weighted expert outputs in
   slot order.

The unbalanced reference is the same layer under Megatron-LM's static placement with every token computed at
home; :func:`reference_forward` computes it in one process without communication.

Integer split rule (shared by every executor of plans)
------------------------------------------------------
``BatchPlan.assign[m, l, e, :]`` says how many of expert ``e``'s tokens each GPU computes; how many of
them each source GPU sends to each copy is :func:`relibra.executors.split.split_counts` (re-exported here):
an integer rounding of the proportional split whose per-source sums are the loads and whose per-copy sums
are exactly ``assign``. The slots themselves are taken in token order (slot ``t * k + i`` for token ``t``,
top-k position ``i``): the first ``n[j, e, 0]`` go to GPU 0, the next ``n[j, e, 1]`` to GPU 1, and so on.

Expert weights are flat rows of ``P = 3 * hidden * ffn`` values: ``gate [ffn, hidden]``, ``up [ffn, hidden]``,
``down [hidden, ffn]``; an expert computes ``down @ (silu(gate @ x) * (up @ x))``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from relibra.executors.replica_buffer import ReplicaBuffer, SlotCopies, fill_slots, reduce_slot_grads
from relibra.executors.split import split_counts

__all__ = [
    "DispatchCounts",
    "EPMoEModel",
    "ExpertShape",
    "MicroBatchPlan",
    "dense_init",
    "dispatch_counts",
    "expert_ffn",
    "expert_init",
    "reference_forward",
    "split_counts",
]

REDUNDANT_TAG_BASE = 1 << 12
"""P2P tags of redundant slots start here so they never match replica-slot tags."""


@dataclass(frozen=True)
class ExpertShape:
    """Shape of one expert FFN."""

    hidden: int
    ffn: int

    @property
    def params(self) -> int:
        """Values in one expert's flat weight row (``3 * hidden * ffn``)."""
        return 3 * self.hidden * self.ffn


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch's slice of a :class:`~relibra.types.BatchPlan`."""

    home: np.ndarray
    """int [L, E]: home GPU of each expert."""
    assign: np.ndarray
    """int [L, E, G]: tokens of expert e computed on GPU g."""
    load: np.ndarray
    """int [L, G, E]: slots of source GPU j routed to expert e."""
    replicas: np.ndarray | None = None
    """int [L, G, r] or None: expert in each replica slot (-1 empty)."""
    redundant: np.ndarray | None = None
    """int [L, G, R] or None: expert in each redundant slot (-1 empty)."""


# ---------------------------------------------------------------------------------------------- math
def expert_init(layer: int, expert: int, shape: ExpertShape, seed: int = 0) -> torch.Tensor:
    """Self-identifying weights of expert ``(layer, expert)``: float32 [P], a function of the ids only."""
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + layer) * 100_003 + expert) & 0x7FFF_FFFF)
    fh = shape.hidden * shape.ffn
    w = torch.randn(shape.params, generator=gen)
    w[: 2 * fh] /= shape.hidden**0.5
    w[2 * fh :] /= shape.ffn**0.5
    return w


def dense_init(
    layer: int, shape: ExpertShape, num_experts: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replicated (data-parallel) weights of layer ``l``: attention stand-in [H, H] and router [E, H]."""
    gen = torch.Generator().manual_seed((seed * 7_919 + layer + 1) & 0x7FFF_FFFF)
    h = shape.hidden
    return torch.randn(h, h, generator=gen) / h, torch.randn(num_experts, h, generator=gen) / h**0.5


def expert_ffn(x: torch.Tensor, w: torch.Tensor, shape: ExpertShape) -> torch.Tensor:
    """x [N, H], one flat weight row w [P] -> [N, H]."""
    h, f = shape.hidden, shape.ffn
    gate = w[: f * h].view(f, h)
    up = w[f * h : 2 * f * h].view(f, h)
    down = w[2 * f * h :].view(h, f)
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def attention_standin(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The dense, communication-free part of a layer the replica copy overlaps: h [T, H] -> [T, H]."""
    return h + torch.tanh(h @ w.T)


def router_probs(a: torch.Tensor, w_router: torch.Tensor, routes: np.ndarray) -> torch.Tensor:
    """Router softmax at the replayed experts. a [T, H], w_router [E, H], routes [T, k] -> [T, k]."""
    probs = torch.softmax(a @ w_router.T, dim=-1)
    return probs.gather(1, torch.as_tensor(routes, dtype=torch.long, device=a.device))


def _combine(y_slots: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """y_slots [T * k, H] in slot order, probs [T, k] -> [T, H] (slots summed in top-k order)."""
    t, k = probs.shape
    return (y_slots.view(t, k, y_slots.shape[-1]) * probs.unsqueeze(-1)).sum(dim=1)


def reference_forward(
    hidden: torch.Tensor,
    routes: np.ndarray,
    attn: torch.Tensor,
    router: torch.Tensor,
    experts: torch.Tensor,
    shape: ExpertShape,
) -> torch.Tensor:
    """The unbalanced layer stack in one process. hidden [T, H], routes [T, L, k], attn [L, H, H],
    router [L, E, H], experts [L, E, P] -> [T, H]."""
    h = hidden
    _, num_layers, k = routes.shape
    for layer in range(num_layers):
        a = attention_standin(h, attn[layer])
        probs = router_probs(a, router[layer], routes[:, layer])
        flat = routes[:, layer].reshape(-1)
        by_expert = np.argsort(flat, kind="stable")
        tok = torch.as_tensor(by_expert // k, dtype=torch.long, device=a.device)
        counts = np.bincount(flat, minlength=experts.shape[1])
        x = a.index_select(0, tok)
        outs, start = [], 0
        for e in np.flatnonzero(counts):
            outs.append(expert_ffn(x[start : start + counts[e]], experts[layer, e], shape))
            start += int(counts[e])
        y = torch.cat(outs) if outs else a.new_zeros((0, shape.hidden))
        y_slots = y.index_select(0, torch.as_tensor(np.argsort(by_expert), dtype=torch.long, device=a.device))
        h = a + _combine(y_slots, probs)
    return h


# ------------------------------------------------------------------------------------------ dispatch
@dataclass(frozen=True)
class DispatchCounts:
    """Where one rank's slots go and how its received rows group by expert, for one (micro-batch, layer).

    DeepEP calls the counts part of this the dispatch layout: ``Buffer.get_dispatch_layout`` (DeepEP
    ``deep_ep/buffer.py``) returns the tokens sent to each rank and to each expert before its dispatch; here
    the splits count rows (token-expert slots), and the index tensors say which rows and in what order.
    """

    send_token: torch.Tensor
    """long [T * k]: token of each sent row (rows ordered by destination GPU, expert, token)."""
    send_inverse: torch.Tensor
    """long [T * k]: position among sent rows of each slot ``t * k + i``."""
    send_splits: list[int]
    """[G]: rows sent to each GPU."""
    recv_splits: list[int]
    """[G]: rows received from each GPU."""
    group_order: torch.Tensor
    """long [N]: received rows reordered by (expert, source GPU)."""
    group_inverse: torch.Tensor
    """long [N]: the inverse permutation."""
    expert_rows: tuple[tuple[int, int], ...]
    """(expert, rows) of each expert this rank computes, in grouped order (rows > 0)."""


def dispatch_counts(
    routes: np.ndarray, split: np.ndarray, rank: int, device: torch.device | str = "cpu"
) -> DispatchCounts:
    """routes [T, k] of this rank for one layer, split [G, E, G] (:func:`split_counts`) -> its dispatch counts
    (index tensors on ``device``)."""
    num_gpus, num_experts, _ = split.shape
    k = routes.shape[1]
    flat = routes.reshape(-1)
    mine = split[rank]  # [E, G]
    if flat.size != int(mine.sum()):
        raise ValueError(
            f"rank {rank}: routes hold {flat.size} slots but the plan's load has {int(mine.sum())}"
        )
    # Step 1: slots grouped by expert in token order, then each group cut over the copies (g ascending).
    by_expert = np.argsort(flat, kind="stable")  # [T * k]
    dest = np.repeat(np.tile(np.arange(num_gpus), num_experts), mine.reshape(-1))  # [T * k], aligned
    send_slots = by_expert[np.argsort(dest, kind="stable")]  # destination-major, then expert, then token
    # Step 2: the receive side knows every source's split, so it knows each received row's expert.
    from_src = split[:, :, rank]  # [G(src), E]
    recv_expert = np.repeat(np.tile(np.arange(num_experts), num_gpus), from_src.reshape(-1))  # [N]
    group = np.argsort(recv_expert, kind="stable")
    rows = from_src.sum(axis=0)
    as_long = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)  # noqa: E731
    return DispatchCounts(
        send_token=as_long(send_slots // k),
        send_inverse=as_long(np.argsort(send_slots)),
        send_splits=[int(v) for v in mine.sum(axis=0)],
        recv_splits=[int(v) for v in from_src.sum(axis=1)],
        group_order=as_long(group),
        group_inverse=as_long(np.argsort(group)),
        expert_rows=tuple((int(e), int(rows[e])) for e in np.flatnonzero(rows)),
    )


@dataclass
class StageTimer:
    """Per-(micro-batch, layer) seconds of the MoE stages on one rank (forward and backward)."""

    forward: dict[tuple[int, int], float] = field(default_factory=dict)
    backward: dict[tuple[int, int], float] = field(default_factory=dict)
    fill_wait: dict[tuple[int, int], float] = field(default_factory=dict)
    _bwd_start: dict[tuple[int, int], float] = field(default_factory=dict)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, timer, key, role):  # type: ignore[override]
        ctx.splits = (send_splits, recv_splits)
        ctx.timer, ctx.key, ctx.role = timer, key, role
        out = x.new_empty((sum(recv_splits), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        if ctx.timer is not None and ctx.role == "combine":
            ctx.timer._bwd_start[ctx.key] = time.perf_counter()
        out = grad.new_empty((sum(send_splits), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits)
        if ctx.timer is not None and ctx.role == "dispatch":
            ctx.timer.backward[ctx.key] = time.perf_counter() - ctx.timer._bwd_start.pop(ctx.key)
        return out, None, None, None, None, None


@dataclass(frozen=True)
class _ComputeSpec:
    """What the compute stage of one (rank, micro-batch, layer) needs besides tensors."""

    shape: ExpertShape
    segments: tuple[tuple[int, int, int, int], ...]
    """(expert, rows, store, index): store 0 home rows, 1 replica slots, 2 redundant slots."""
    buffer: ReplicaBuffer
    replica_copies: SlotCopies
    redundant: torch.Tensor
    """[R, P]: this layer's redundant slots."""
    redundant_copies: SlotCopies
    slot_of: dict[int, int]


def _run_experts(x: torch.Tensor, stores: tuple[torch.Tensor, ...], spec: _ComputeSpec) -> torch.Tensor:
    outs, start = [], 0
    for _, rows, store, idx in spec.segments:
        outs.append(expert_ffn(x[start : start + rows], stores[store][idx], spec.shape))
        start += rows
    return torch.cat(outs) if outs else x.new_zeros((0, spec.shape.hidden))


class _ExpertCompute(torch.autograd.Function):
    """Grouped expert compute over home rows and slot copies.

    Backward refills the replica buffer (it held later layers meanwhile), recomputes the local expert graph,
    and reduces every slot copy's weight gradient into its home expert's gradient.
    """

    @staticmethod
    def forward(ctx, x, local_w, spec):  # type: ignore[override]
        ctx.spec = spec
        ctx.save_for_backward(x, local_w)
        return _run_experts(x, (local_w, spec.buffer.weights, spec.redundant), spec)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, local_w = ctx.saved_tensors
        spec: _ComputeSpec = ctx.spec
        if not spec.replica_copies.empty:
            spec.buffer.start_fill(spec.replica_copies, local_w, spec.slot_of).wait()
        with torch.enable_grad():
            leaves = (
                x.detach().requires_grad_(),
                local_w.detach().requires_grad_(),
                spec.buffer.weights.detach().requires_grad_(),
                spec.redundant.detach().requires_grad_(),
            )
            y = _run_experts(leaves[0], leaves[1:], spec)
            grads = torch.autograd.grad(y, leaves, grad, allow_unused=True) if y.numel() else (None,) * 4
        gx, gw, grep, gred = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))
        spec.buffer.grads.copy_(grep)
        spec.buffer.reduce_grads(spec.replica_copies, gw, spec.slot_of)
        if not spec.redundant_copies.empty:
            reduce_slot_grads(gred, spec.redundant_copies, gw, spec.slot_of, tag_base=REDUNDANT_TAG_BASE)
        return gx, gw, None


# ---------------------------------------------------------------------------------------------- model
class EPMoEModel(nn.Module):
    """One rank's share of an ``L``-layer MoE stack: dense weights (replicated), its home experts, the
    layer-shared replica buffer, and permanent redundant slots.

    Parameters: ``attn`` [L, H, H], ``router`` [L, E, H], ``experts[l]`` [E / G, P] (row ``i`` holds expert
    ``slot_expert[l, i]``).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        shape: ExpertShape,
        rank: int,
        num_gpus: int,
        replica_slots: int,
        redundant_slots: int = 0,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if num_experts % num_gpus:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {num_gpus}")
        self.num_layers, self.num_experts, self.shape = num_layers, num_experts, shape
        self.rank, self.num_gpus, self.seed = rank, num_gpus, seed
        self.device = torch.device(device)
        dense = [dense_init(layer, shape, num_experts, seed) for layer in range(num_layers)]
        self.attn = nn.Parameter(torch.stack([d[0] for d in dense]).to(self.device))
        self.router = nn.Parameter(torch.stack([d[1] for d in dense]).to(self.device))
        per_gpu = num_experts // num_gpus
        self.experts = nn.ParameterList(
            [nn.Parameter(torch.zeros(per_gpu, shape.params, device=self.device)) for _ in range(num_layers)]
        )
        self.slot_expert = np.full((num_layers, per_gpu), -1, dtype=np.int64)
        """int [L, E / G]: expert held by each home row."""
        self.buffer = ReplicaBuffer(replica_slots, shape.params, device=self.device)
        self.redundant = torch.zeros(num_layers, redundant_slots, shape.params, device=self.device)
        """[L, R, P]: permanent redundant copies (refreshed by :meth:`fill_redundant`)."""
        self.home: np.ndarray | None = None
        """int [L, E]: the placement the home rows currently follow."""

    def place_initial(self, home: np.ndarray) -> None:
        """Initialise home rows for placement home [L, E] (experts ascending in each GPU's rows)."""
        self.home = np.asarray(home, dtype=np.int64).copy()
        with torch.no_grad():
            for layer in range(self.num_layers):
                mine = np.flatnonzero(self.home[layer] == self.rank)
                self.slot_expert[layer] = mine
                for i, e in enumerate(mine):
                    self.experts[layer][i].copy_(expert_init(layer, int(e), self.shape, self.seed))

    def slot_of(self, layer: int) -> dict[int, int]:
        return {int(e): i for i, e in enumerate(self.slot_expert[layer])}

    def fill_redundant(self, redundant: np.ndarray | None) -> None:
        """Copy home weights into the redundant slots, redundant [L, G, R] (or None: no redundant slots)."""
        if redundant is None:
            return
        assert self.home is not None
        for layer in range(self.num_layers):
            copies = SlotCopies.from_slots(redundant[layer], self.home[layer], self.rank)
            fill_slots(
                self.redundant[layer], copies, self.experts[layer], self.slot_of(layer), REDUNDANT_TAG_BASE
            ).wait()

    def _segments(self, layer: int, dispatch: DispatchCounts, plan: MicroBatchPlan) -> tuple:
        slot_of = self.slot_of(layer)
        reps = [] if plan.replicas is None else list(plan.replicas[layer, self.rank])
        red = [] if plan.redundant is None else list(plan.redundant[layer, self.rank])
        segments = []
        for e, rows in dispatch.expert_rows:
            if e in slot_of:
                segments.append((e, rows, 0, slot_of[e]))
            elif e in reps:
                segments.append((e, rows, 1, reps.index(e)))
            elif e in red:
                segments.append((e, rows, 2, red.index(e)))
            else:
                raise RuntimeError(
                    f"rank {self.rank}, layer {layer}: received tokens of expert {e} without a copy"
                )
        return tuple(segments)

    def forward(
        self,
        hidden: torch.Tensor,
        routes: np.ndarray,
        plan: MicroBatchPlan,
        timer: StageTimer | None = None,
        microbatch: int = 0,
    ) -> torch.Tensor:
        """hidden [T, H] of this rank, its replayed routes [T, L, k], the micro-batch plan -> [T, H]."""
        if self.home is None or not np.array_equal(self.home, plan.home):
            raise RuntimeError(
                f"rank {self.rank}: the home rows do not follow the plan's placement; apply it with "
                "reorder_ops.reorder_experts (or place_initial) first"
            )
        h = hidden
        empty_slots = np.full((self.num_gpus, 0), -1)
        for layer in range(self.num_layers):
            key = (microbatch, layer)
            slot_of = self.slot_of(layer)
            reps = empty_slots if plan.replicas is None else plan.replicas[layer]
            rep_copies = SlotCopies.from_slots(reps, self.home[layer], self.rank)
            red_copies = SlotCopies.from_slots(
                empty_slots if plan.redundant is None else plan.redundant[layer], self.home[layer], self.rank
            )
            fill = self.buffer.start_fill(rep_copies, self.experts[layer], slot_of)
            a = attention_standin(h, self.attn[layer])  # overlaps the replica copy
            probs = router_probs(a, self.router[layer], routes[:, layer])
            waited = fill.wait()
            t0 = time.perf_counter()
            split = split_counts(plan.load[layer], plan.assign[layer])
            dispatch = dispatch_counts(routes[:, layer], split, self.rank, self.device)
            spec = _ComputeSpec(
                shape=self.shape,
                segments=self._segments(layer, dispatch, plan),
                buffer=self.buffer,
                replica_copies=rep_copies,
                redundant=self.redundant[layer],
                redundant_copies=red_copies,
                slot_of=slot_of,
            )
            x_recv = _AllToAll.apply(
                a.index_select(0, dispatch.send_token),
                dispatch.send_splits,
                dispatch.recv_splits,
                timer,
                key,
                "dispatch",
            )
            y = _ExpertCompute.apply(x_recv.index_select(0, dispatch.group_order), self.experts[layer], spec)
            y_back = _AllToAll.apply(
                y.index_select(0, dispatch.group_inverse),
                dispatch.recv_splits,
                dispatch.send_splits,
                timer,
                key,
                "combine",
            )
            h = a + _combine(y_back.index_select(0, dispatch.send_inverse), probs)
            if timer is not None:
                timer.forward[key] = time.perf_counter() - t0
                timer.fill_wait[key] = waited
        return h

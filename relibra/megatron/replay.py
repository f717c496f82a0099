"""Routing replay through megatron-core's ``RouterReplay``: feed a trace's routes, record routes into a trace.

Megatron-core (``moe_enable_routing_replay=True``) gives every ``TopKRouter`` a ``RouterReplay`` instance,
kept in the class-level list ``RouterReplay.global_router_replay_instances`` in build order (one per MoE
layer). With the action ``REPLAY_FORWARD`` a router takes its top-k expert ids from the instance's target
indices and gathers the router scores at them, so the probabilities keep their gradient; with ``RECORD``
it computes the top-k as usual and keeps the ids. This module speaks the trace format's language
(``experts`` int16 ``[T, L, k]``, samples concatenated in token order) on one side and Megatron's
(one ``LongTensor [T, k]`` per layer) on the other.

Replay is ignored on the fused router path (``moe_router_fusion=True``) and under the load-balancing types
that pick their own top-k (sinkhorn; quantile balancing from megatron-core 0.19.2 on:
:attr:`~relibra.megatron.compat.MegatronApi.replay_bypassing_balancing`), where the routes would silently
be recomputed, so :func:`check_replay_config` refuses those configurations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from relibra.megatron.compat import megatron_api
from relibra.trace.format import RoutingTrace

__all__ = [
    "check_replay_config",
    "clear_router_replay",
    "recorded_routes",
    "recording",
    "replay_instances",
    "replaying",
    "routes_to_trace",
    "set_replay_routes",
    "trace_routes",
]


def _replay_types() -> tuple[Any, Any]:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    megatron_api()  # refuses an unsupported release

    return RouterReplay, RouterReplayAction


def check_replay_config(config: Any) -> None:
    """Refuse a ``TransformerConfig`` under which replayed routes would not be used."""
    if not getattr(config, "moe_enable_routing_replay", False):
        raise ValueError("config.moe_enable_routing_replay is False; set it to True so routers replay routes")
    if getattr(config, "moe_router_fusion", False):
        raise ValueError(
            "config.moe_router_fusion=True: the fused router path ignores RouterReplay; "
            "set moe_router_fusion=False"
        )
    balancing = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    api = megatron_api()
    if balancing in api.replay_bypassing_balancing:
        raise ValueError(
            f"config.moe_router_load_balancing_type={balancing!r} bypasses RouterReplay in megatron-core "
            f"{api.version}; use 'aux_loss' or 'none'"
        )
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        raise ValueError(
            "config.moe_expert_capacity_factor is set: token dropping changes the replayed routes; "
            "use None (dropless)"
        )


def replay_instances(routers: Sequence[Any] | None = None) -> list[Any]:
    """The ``RouterReplay`` instances of ``routers`` (objects with ``.router_replay``), or all of them.

    Without ``routers`` this is Megatron's global list, in build order; pass a model's routers when several
    models live in one process.
    """
    replay_cls, _ = _replay_types()
    if routers is None:
        return list(replay_cls.global_router_replay_instances)
    out = [r.router_replay for r in routers]
    if any(inst is None for inst in out):
        raise ValueError("a router has no RouterReplay; build the model with moe_enable_routing_replay=True")
    foreign = [inst for inst in out if not isinstance(inst, replay_cls)]
    if foreign:
        kind = type(foreign[0])
        raise ValueError(
            f"a router's replay is {kind.__module__}.{kind.__qualname__}, not megatron-core's RouterReplay: "
            "a trainer's patch replaced it (verl's apply_router_replay_patch does) and ignores "
            "megatron-core's actions, so the layer would route natively; replay through that trainer "
            "(relibra.integrations)"
        )
    return out


def _check_routes(routes: np.ndarray, num_layers: int, num_experts: int | None) -> np.ndarray:
    routes = np.asarray(routes)
    if routes.ndim != 3 or not np.issubdtype(routes.dtype, np.integer):
        raise ValueError(f"routes: expected integer [T, L, k], got {routes.dtype} {routes.shape}")
    if routes.shape[1] != num_layers:
        raise ValueError(
            f"routes hold {routes.shape[1]} layers but there are {num_layers} RouterReplay instances"
        )
    if routes.size and (routes.min() < 0 or (num_experts is not None and routes.max() >= num_experts)):
        raise ValueError(
            f"routes: expert ids span [{routes.min()}, {routes.max()}]; expected [0, {num_experts})"
        )
    distinct = np.sort(routes, axis=-1)
    if routes.shape[2] > 1 and (distinct[..., 1:] == distinct[..., :-1]).any():
        t, layer, _ = np.argwhere(distinct[..., 1:] == distinct[..., :-1])[0]
        raise ValueError(
            f"routes[{t}, {layer}] names one expert twice; top-k experts of a token must be distinct"
        )
    return routes


def set_replay_routes(
    routes: np.ndarray,
    routers: Sequence[Any] | None = None,
    num_experts: int | None = None,
    action: str = "REPLAY_FORWARD",
) -> None:
    """Replay routes [T, L, k] (this rank's tokens, in the order of its hidden states' flattened tokens).

    Clears earlier targets first (Megatron appends every target to the instances' backward-replay lists),
    then sets layer ``l``'s targets to ``routes[:, l]`` and the action of every instance.
    """
    _, action_enum = _replay_types()
    instances = replay_instances(routers)
    routes = _check_routes(routes, len(instances), num_experts)
    per_layer = torch.as_tensor(
        np.ascontiguousarray(routes.transpose(1, 0, 2)), dtype=torch.long
    )  # [L, T, k]
    for layer, inst in enumerate(instances):
        inst.clear_indices()
        inst.set_target_indices(per_layer[layer])
        inst.set_router_replay_action(action_enum[action])


def clear_router_replay(routers: Sequence[Any] | None = None) -> None:
    """Drop targets, records and actions: routers compute their own top-k again."""
    for inst in replay_instances(routers):
        inst.clear_indices()
        inst.clear_router_replay_action()


def recorded_routes(routers: Sequence[Any] | None = None) -> np.ndarray:
    """The routes recorded by the last forward under ``RECORD``: int64 [T, L, k]."""
    instances = replay_instances(routers)
    recorded = [inst.get_recorded_indices() for inst in instances]
    missing = [i for i, r in enumerate(recorded) if r is None]
    if missing:
        raise RuntimeError(f"layers {missing} recorded nothing; run a forward inside recording() first")
    return np.stack([r.detach().cpu().numpy() for r in recorded], axis=1).astype(np.int64)


@contextlib.contextmanager
def recording(routers: Sequence[Any] | None = None) -> Iterator[None]:
    """Record routes in the forwards inside the block (rollout); read them with :func:`recorded_routes`."""
    _, action_enum = _replay_types()
    instances = replay_instances(routers)
    for inst in instances:
        inst.clear_indices()
        inst.set_router_replay_action(action_enum.RECORD)
    try:
        yield
    finally:
        for inst in instances:
            inst.clear_router_replay_action()


@contextlib.contextmanager
def replaying(
    routes: np.ndarray, routers: Sequence[Any] | None = None, num_experts: int | None = None
) -> Iterator[None]:
    """Replay routes [T, L, k] during the forwards inside the block, then clear the replay state."""
    set_replay_routes(routes, routers, num_experts)
    try:
        yield
    finally:
        clear_router_replay(routers)


def routes_to_trace(
    sample_routes: Sequence[np.ndarray],
    num_experts: int,
    model: str,
    source: str = "megatron-core RouterReplay RECORD",
    batch_offsets: np.ndarray | None = None,
    **meta: Any,
) -> RoutingTrace:
    """Recorded routes of each sample (int [T_s, L, k], in sample order) -> a :class:`RoutingTrace`."""
    if not sample_routes:
        raise ValueError("sample_routes is empty; expected the recorded routes of at least one sample")
    shapes = {tuple(r.shape[1:]) for r in sample_routes}
    if len(shapes) != 1:
        raise ValueError(
            f"samples disagree on [L, k]: {sorted(shapes)}; every sample must come from one model"
        )
    ((num_layers, top_k),) = shapes
    lengths = np.array([r.shape[0] for r in sample_routes], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return RoutingTrace(
        experts=np.concatenate(sample_routes).astype(np.int16),
        sample_offsets=offsets,
        batch_offsets=(
            np.array([0, len(sample_routes)], dtype=np.int64)
            if batch_offsets is None
            else np.asarray(batch_offsets, dtype=np.int64)
        ),
        meta={
            "num_experts": num_experts,
            "top_k": top_k,
            "num_layers": num_layers,
            "model": model,
            "source": source,
            **meta,
        },
    )


def trace_routes(trace: RoutingTrace, samples: Sequence[int] | np.ndarray) -> np.ndarray:
    """Routes of ``samples`` (in the given order, concatenated) from a trace: int64 [T, L, k]."""
    parts = [trace.sample(int(s)) for s in samples]
    if not parts:
        return np.zeros((0, trace.num_layers, trace.top_k), dtype=np.int64)
    return np.concatenate(parts).astype(np.int64)

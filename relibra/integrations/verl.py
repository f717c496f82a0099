"""ReLibra inside verl: plan each RL step from the rollout's routes, train the step on its plan.

How-to: docs/integrations.md.

Two hooks, one per side of verl's single-controller design, importing verl lazily (verl 0.9.1; its files
named below):

* :class:`VerlReLibraHook`, on the driver (``RayPPOTrainer.fit``, ``verl/trainer/ppo/ray_trainer.py``):

  1. :meth:`~VerlReLibraHook.after_rollout`, right after ``_balance_batch``: reads the batch's
     ``routed_experts`` (R3, :func:`relibra.trace.importers.from_verl`), lays the samples out over the EP
     group with exactly ``ppo_micro_batch_size_per_gpu`` samples per GPU per micro-batch
     (:func:`relibra.integrations.layout.fixed_count_layout`: what verl's static micro-batching can
     reproduce) and seals the batch in the :class:`~relibra.control.plane.ControlPlane`, which plans in
     its workers while verl computes rewards and the old / reference log-probabilities;
  2. :meth:`~VerlReLibraHook.before_update`, right before ``_update_actor``: takes the plan (by its
     deadline), reorders the batch (``DataProto.reorder``) so that verl's dispatch (data-parallel rank
     ``g`` gets the ``g``-th contiguous chunk, ``dispatch_nd_compute_dataproto``) and its micro-batching
     (contiguous ``ppo_micro_batch_size_per_gpu`` samples, ``prepare_micro_batches``) give every rank the
     samples the plan gives it, in the plan's micro-batches; and writes :func:`fill_route` into each
     sample's unrecorded last row (the rollout records every token but the last; verl leaves that row's
     zeros and routes it natively through its R3 replay mask). Returns the :class:`VerlStepPlan` every
     actor rank needs.

* :class:`VerlActorHook`, in each actor rank, around ``update_actor``: :meth:`~VerlActorHook.begin_update`
  moves experts to the plan's placement (weights, gradients, Adam state: ``MegatronPlanAdapter``) and
  arms a forward pre-hook on every MoE layer that, for each training micro-batch, sets the plan's
  replicas and token split (``set_microbatch``) and checks the replay: every layer's ``RouterReplay``
  must be in ``REPLAY_FORWARD`` holding targets for exactly this micro-batch's tokens, else
  :class:`ReplayFallbackError`. verl's ``RouterReplay`` (``apply_router_replay_patch``,
  ``verl/utils/megatron/router_replay_patch.py``) and megatron-core's both silently compute native
  routes when a target is missing; the check makes that impossible to miss, and the adapter's router
  refuses any routing whose per-expert counts differ from the plan's loads. verl's replay targets are
  used as they are (``set_router_replay_data``); only the R3 replay mask, which leaves each sample's last
  row to native routing, is lifted so that row replays the filler the plan counted (its logits feed no
  loss: verl's ``build_r3_replay_mask`` says so).

What the hook cannot honour is refused before any work, naming the verl key (:func:`check_verl_config`):
dynamic batch size, shuffled mini-batches, R2 or disabled replay, tensor / pipeline / context
parallelism, an EP group other than all GPUs, padded (BSHD) micro-batches, FP8 padding, activation
recomputation, a planner whose locality round moves samples between GPUs (verl's micro-batches hold a
fixed number of samples per GPU), and a cost model priced with ``parallel.tp * parallel.cp > 1`` (the hook
lays whole samples on GPUs).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.control.config import ControlPlaneConfig
from relibra.control.plane import ControlPlane
from relibra.cost.model import CostModel
from relibra.integrations.layout import fixed_count_layout
from relibra.layout import SampleLayout
from relibra.planners.protocols import Planner, StagedPlanner, StagedReorderer
from relibra.trace.format import RoutingTrace, TraceFormatError
from relibra.trace.importers import fill_route, from_verl
from relibra.types import BatchPlan

__all__ = [
    "ReplayFallbackError",
    "VerlActorHook",
    "VerlConfigError",
    "VerlReLibraHook",
    "VerlSettings",
    "VerlStepPlan",
    "check_replay_targets",
    "check_verl_config",
    "step_order",
    "verl_cpu_patches",
]

ACTOR = "actor_rollout_ref.actor"
MEGATRON = f"{ACTOR}.megatron"
MICRO_BATCH_KEY = f"{ACTOR}.ppo_micro_batch_size_per_gpu"
REPLAY_MODE_KEYS = (f"{MEGATRON}.router_replay.mode", f"{ACTOR}.router_replay.mode")
"""Where verl keeps the actor's router replay mode: under the Megatron engine config (0.9.1), or on the
actor config (earlier releases)."""


class VerlConfigError(ValueError):
    """A verl setting the hook cannot honour; the message names the key."""


class ReplayFallbackError(RuntimeError):
    """A MoE layer would compute native routes instead of replaying the routes the plan was made from."""


# ----------------------------------------------------------------------------------- configuration
_MISSING = object()


def _get(config: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is _MISSING:
                raise VerlConfigError(f"{key} is missing from the verl config")
            return default
        node = node[part]
    return node


def _require(config: Mapping[str, Any], key: str, ok: Any, what: str, default: Any = _MISSING) -> Any:
    value = _get(config, key, default)
    if not ok(value):
        raise VerlConfigError(f"{key}={value!r}: {what}")
    return value


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class VerlSettings:
    """What the hook takes from a verl config (:func:`check_verl_config`)."""

    num_gpus: int
    """``trainer.nnodes * trainer.n_gpus_per_node``: the data-parallel group, which is the EP group."""
    samples_per_microbatch: int
    """``actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu``."""
    mini_batch_size: int
    """Samples per optimizer step over all ranks: ``ppo_mini_batch_size * rollout.n``."""
    epochs: int
    """``actor_rollout_ref.actor.ppo_epochs``: passes over the batch (same micro-batches each pass)."""


def check_verl_config(config: Mapping[str, Any]) -> VerlSettings:
    """Refuse the settings the hook cannot honour (module doc), each with one message naming the key.

    ``config``: verl's trainer config (an OmegaConf ``DictConfig`` or a plain nested mapping).
    """
    _require(
        config, f"{ACTOR}.strategy", lambda v: v == "megatron", "the hook drives the Megatron actor only"
    )
    mode_key = next((k for k in REPLAY_MODE_KEYS if _get(config, k, None) is not None), REPLAY_MODE_KEYS[0])
    _require(
        config,
        mode_key,
        lambda v: v == "R3",
        "the hook plans from the rollout's routes: set R3 (R2 records routes in the actor's "
        "old-log-prob forward, after the hook submits the batch; not supported yet)",
    )
    _require(
        config,
        "actor_rollout_ref.rollout.enable_rollout_routing_replay",
        lambda v: v is True,
        "R3 needs the rollout to return its routes: set true",
    )
    _require(
        config,
        f"{ACTOR}.use_dynamic_bsz",
        lambda v: v is False,
        "dynamic batch size forms micro-batches by tokens, which the plan's sample layout cannot reproduce: "
        f"set false and {MICRO_BATCH_KEY}",
    )
    _require(
        config,
        f"{ACTOR}.shuffle",
        lambda v: v is False,
        "shuffled mini-batches break the plan's layout: set false",
    )
    micro = _require(config, MICRO_BATCH_KEY, _positive, "must be a positive number of samples per GPU")
    for key, default, ok, what in (
        (
            f"{MEGATRON}.tensor_model_parallel_size",
            1,
            lambda v: v == 1,
            "tensor parallelism is not supported yet",
        ),
        (
            f"{MEGATRON}.pipeline_model_parallel_size",
            1,
            lambda v: v == 1,
            "pipeline parallelism is not supported yet",
        ),
        (
            f"{MEGATRON}.virtual_pipeline_model_parallel_size",
            None,
            lambda v: v in (None, 1),
            "virtual pipeline stages are not supported yet",
        ),
        (
            f"{MEGATRON}.context_parallel_size",
            1,
            lambda v: v == 1,
            "context parallelism is not supported yet",
        ),
        (
            f"{MEGATRON}.expert_tensor_parallel_size",
            None,
            lambda v: v in (None, 1),
            "expert tensor parallelism is not supported yet",
        ),
        (
            f"{MEGATRON}.dynamic_context_parallel",
            False,
            lambda v: v is False,
            "dynamic context parallelism reschedules samples",
        ),
        (
            f"{MEGATRON}.use_remove_padding",
            True,
            lambda v: v is True,
            "padded (BSHD) micro-batches route their padding tokens, which no plan counts: set true",
        ),
        (
            f"{MEGATRON}.pad_to_length",
            False,
            lambda v: v is False,
            "padding to a length bucket adds routed tokens",
        ),
        (
            f"{MEGATRON}.override_transformer_config.fp8",
            None,
            lambda v: v is None,
            "FP8 pads each sequence with routed tokens no plan counts",
        ),
        (
            f"{MEGATRON}.vanilla_mbridge",
            True,
            lambda v: v is True,
            "ReLibra builds and loads the physical model through mbridge only (Megatron-Bridge's "
            "load_hf_weights is not wired): set true",
        ),
        (
            f"{MEGATRON}.use_distributed_optimizer",
            True,
            lambda v: v is True,
            "Megatron's non-distributed optimizers keep master weights the adapter cannot move with the "
            "experts: set true",
        ),
        (
            f"{ACTOR}.optim.use_precision_aware_optimizer",
            False,
            lambda v: v is False,
            "the precision-aware optimizer keeps scaled copies the adapter cannot move with the experts",
        ),
        (
            f"{MEGATRON}.override_transformer_config.recompute_granularity",
            None,
            lambda v: v is None,
            "activation recomputation of the MoE layer is not supported by the adapter yet",
        ),
    ):
        _require(config, key, ok, what, default)
    nodes = _require(config, "trainer.nnodes", _positive, "must be a positive number of nodes")
    per_node = _require(config, "trainer.n_gpus_per_node", _positive, "must be a positive number of GPUs")
    num_gpus = nodes * per_node
    _require(
        config,
        f"{MEGATRON}.expert_model_parallel_size",
        lambda v: v == num_gpus,
        f"the adapter's EP group is every GPU (trainer.nnodes * trainer.n_gpus_per_node = {num_gpus})",
    )
    mini = _require(config, f"{ACTOR}.ppo_mini_batch_size", _positive, "must be a positive number of prompts")
    n = _require(config, "actor_rollout_ref.rollout.n", _positive, "must be a positive number of samples")
    if (mini * n) % (num_gpus * micro):
        raise VerlConfigError(
            f"{ACTOR}.ppo_mini_batch_size={mini}: times rollout.n={n} it must be a multiple of "
            f"{num_gpus} GPUs x {MICRO_BATCH_KEY}={micro}, so that every mini-batch holds whole micro-batches"
        )
    epochs = _require(config, f"{ACTOR}.ppo_epochs", _positive, "must be a positive number of passes")
    return VerlSettings(num_gpus, micro, mini * n, epochs)


# ------------------------------------------------------------------------------------ driver side
@dataclass(frozen=True)
class VerlStepPlan:
    """What every actor rank needs to train one step on its plan (picklable: send it to the workers)."""

    plan: BatchPlan
    """The batch plan; ``plan.sample_gpu`` is in the order of the batch as rollout left it."""
    order: np.ndarray
    """int64 [S]: row ``i`` of the reordered batch is row ``order[i]`` of the batch as rollout left it."""
    num_microbatches: int
    """``Mb``: micro-batches of each rank per pass over the batch."""
    samples_per_microbatch: int


def step_order(
    sample_gpu: np.ndarray, sample_mb: np.ndarray, num_gpus: int, samples_per_microbatch: int
) -> np.ndarray:
    """The batch order under which verl's contiguous DP chunks and micro-batches follow the plan.

    Rank ``g``'s chunk lists its micro-batches in order, ``K`` samples each (ascending sample id): int64
    [S]. Every (GPU, micro-batch) must hold exactly ``K`` samples, else :class:`ValueError`.
    """
    gpu, mb = np.asarray(sample_gpu, dtype=np.int64), np.asarray(sample_mb, dtype=np.int64)
    num_mb = int(mb.max()) + 1
    held = np.zeros((num_gpus, num_mb), dtype=np.int64)
    np.add.at(held, (gpu, mb), 1)
    if (held != samples_per_microbatch).any():
        g, m = (int(v) for v in np.argwhere(held != samples_per_microbatch)[0])
        raise ValueError(
            f"the plan puts {held[g, m]} samples on GPU {g} in micro-batch {m}; verl's static micro-batches "
            f"({MICRO_BATCH_KEY}={samples_per_microbatch}) need exactly that many on every GPU"
        )
    return np.lexsort((np.arange(gpu.size), mb, gpu)).astype(np.int64)


@dataclass
class _Pending:
    layout: SampleLayout
    lengths: np.ndarray
    """int64 [S]: real tokens per row, to check the batch order is unchanged at before_update."""


class VerlReLibraHook:
    """The driver-side hook (module doc): ``after_rollout`` then ``before_update`` once per RL step."""

    def __init__(
        self,
        planner: Planner,
        settings: VerlSettings,
        cluster: ClusterSpec,
        model: ModelSpec,
        cost: CostModel | None = None,
        *,
        moe_layers: Sequence[int] | None = None,
        config: ControlPlaneConfig | None = None,
    ) -> None:
        if isinstance(planner, StagedPlanner):
            reorderer = planner.reorderer
            if isinstance(reorderer, StagedReorderer) and reorderer.moves_samples:
                raise VerlConfigError(
                    f"planner {planner.name!r} runs the locality round, which moves samples between GPUs; "
                    f"verl's micro-batches hold {MICRO_BATCH_KEY}={settings.samples_per_microbatch} samples "
                    "on every GPU: plan without it (reorder=AnnealConfig(locality=False), "
                    "planner=relibra_no_locality)"
                )
        if cost is not None and cost.parallel.group > 1:
            raise VerlConfigError(
                f"the cost model prices parallel.tp={cost.parallel.tp} x parallel.cp={cost.parallel.cp}, but "
                f"the hook lays whole samples on GPUs ({MEGATRON}.tensor_model_parallel_size and "
                "context_parallel_size > 1 are not supported yet): price the plans with tp = cp = 1"
            )
        if cluster.num_gpus != settings.num_gpus:
            raise VerlConfigError(
                f"trainer.nnodes * trainer.n_gpus_per_node = {settings.num_gpus} GPUs, but the cluster the "
                f"plans are priced on has {cluster.num_gpus}"
            )
        self.settings = settings
        self.model = model
        self.moe_layers = None if moe_layers is None else [int(i) for i in moe_layers]
        self.control_plane = ControlPlane.from_planner(
            planner, cluster, model, cost if cost is not None else CostModel(cluster, model), config
        )
        self._pending: dict[int, _Pending] = {}

    @classmethod
    def from_verl_config(
        cls,
        verl_config: Mapping[str, Any],
        planner: Planner,
        cluster: ClusterSpec,
        model: ModelSpec,
        **kwargs: Any,
    ) -> VerlReLibraHook:
        """:func:`check_verl_config`, then the hook."""
        return cls(planner, check_verl_config(verl_config), cluster, model, **kwargs)

    def after_rollout(self, batch: Any) -> int:
        """Submit the batch's routes and start planning (``batch``: verl's ``DataProto`` after
        ``_balance_batch``). Returns the key :meth:`before_update` takes."""
        routed, mask = batch.batch["routed_experts"], batch.batch["attention_mask"]
        trace = from_verl(
            routed,
            mask,
            self.model.num_experts,
            moe_layers=self.moe_layers,
            unrecorded="fill",
            model=self.model.name,
            source="verl R3 routed_experts",
        )
        self._check_shape(trace)
        layout = fixed_count_layout(
            trace.sample_tokens, self.settings.num_gpus, self.settings.samples_per_microbatch
        )
        self.control_plane.submit(trace)
        key = self.control_plane.seal(layout=layout)
        self._pending[key] = _Pending(layout, trace.sample_tokens.astype(np.int64))
        return key

    def _check_shape(self, trace: RoutingTrace) -> None:
        """Refuse routes of another shape than the model's: planned with another top-k the loads would be
        scaled by ``k / top_k``; another layer count would pair layers wrongly."""
        model = self.model
        if trace.top_k != model.top_k:
            raise TraceFormatError(
                f"routed_experts has top-k {trace.top_k} (its last axis) but model {model.name} routes every "
                f"token to top_k={model.top_k} experts: the batch holds another model's routes"
            )
        if trace.num_layers != model.num_moe_layers:
            picked = "the moe_layers given" if self.moe_layers is not None else "its layer axis (2)"
            raise TraceFormatError(
                f"routed_experts has {trace.num_layers} MoE layers ({picked}) but model {model.name} has "
                f"num_moe_layers={model.num_moe_layers}: pass moe_layers (the MoE layers among every layer "
                "the engine records, moe_layers_from_freq) or the model the routes came from"
            )

    def before_update(self, batch: Any, key: int, deadline_s: float | None = None) -> VerlStepPlan:
        """Take the plan of ``key`` (waiting at most ``deadline_s``), reorder ``batch`` in place for it and
        write the filler into each sample's unrecorded last row (module doc). Returns the step plan."""
        import torch

        pending = self._pending.pop(key)
        mask = batch.batch["attention_mask"]
        lengths = mask.sum(dim=1).cpu().numpy().astype(np.int64)
        if not np.array_equal(lengths, pending.lengths):
            raise ValueError(
                "the batch's rows changed between after_rollout and before_update (their token counts "
                "differ): call after_rollout after _balance_batch and reorder nothing in between"
            )
        plan = self.control_plane.plans(key, deadline_s)
        order = step_order(
            plan.sample_gpu,
            pending.layout.sample_mb,
            self.settings.num_gpus,
            self.settings.samples_per_microbatch,
        )
        routed = batch.batch["routed_experts"]
        last = (mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)).tolist()
        filler = torch.as_tensor(fill_route(routed.shape[2], routed.shape[3]), dtype=routed.dtype)
        for s, t in enumerate(last):
            routed[s, t] = filler
        batch.reorder(torch.as_tensor(order))
        num_mb = int(pending.layout.num_microbatches)
        return VerlStepPlan(plan, order, num_mb, self.settings.samples_per_microbatch)

    def close(self) -> None:
        self.control_plane.close()


# ------------------------------------------------------------------------------------- actor side
def _replay_action(inst: Any, layer: int) -> Any:
    """The ``REPLAY_FORWARD`` member of the enum ``inst`` compares against (verl's or megatron-core's)."""
    verl_patch = sys.modules.get("verl.utils.megatron.router_replay_patch")
    if verl_patch is not None and isinstance(inst, verl_patch.RouterReplay):
        return verl_patch.RouterReplayAction.REPLAY_FORWARD
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if isinstance(inst, RouterReplay):
        return RouterReplayAction.REPLAY_FORWARD
    raise ReplayFallbackError(f"layer {layer}: router replay of unknown type {type(inst).__name__}")


def check_replay_targets(replays: Sequence[Any], num_tokens: int, first_layer: int = 0) -> None:
    """Refuse a forward in which any layer would not replay: ``replays`` are the layers' ``RouterReplay``
    instances (verl's or megatron-core's), ``num_tokens`` this rank's tokens of the micro-batch.

    Lifts verl's R3 replay mask (``target_replay_mask``) so that every row replays (module doc).
    """
    for i, inst in enumerate(replays, start=first_layer):
        if inst is None:
            raise ReplayFallbackError(
                f"layer {i}: its router has no RouterReplay; build the model with routing replay "
                f"({REPLAY_MODE_KEYS[0]}=R3)"
            )
        expected = _replay_action(inst, i)
        if inst.router_replay_action is not expected:
            raise ReplayFallbackError(
                f"layer {i}: router replay action is {inst.router_replay_action!r}, not {expected!r} of "
                f"{type(expected).__module__}: the layer would compute native routes"
            )
        target = inst.target_topk_idx
        if target is None:
            raise ReplayFallbackError(
                f"layer {i}: REPLAY_FORWARD without targets (set_router_replay_data was not called for this "
                "micro-batch): the layer would fall back to native routing"
            )
        if int(target.shape[0]) != num_tokens:
            raise ReplayFallbackError(
                f"layer {i}: replay targets for {int(target.shape[0])} tokens, the micro-batch has "
                f"{num_tokens}"
            )
        if getattr(inst, "target_replay_mask", None) is not None:
            inst.target_replay_mask = None
            if inst.replay_backward_mask_list:
                inst.replay_backward_mask_list[-1] = None


class VerlActorHook:
    """The actor-side hook on one rank (module doc): :meth:`begin_update`, verl's update, :meth:`end_update`.

    ``adapter``: the :class:`~relibra.megatron.adapter.MegatronPlanAdapter` of this rank's MoE layers,
    built before any forward. Outside an update the layers route home-only (the rollout-side forwards:
    old and reference log-probabilities), unchecked.
    """

    def __init__(self, adapter: Any, optimizer: Any = None) -> None:
        self.adapter = adapter
        self.optimizer = optimizer
        """The optimizer whose state moves with the experts (Adam's moments), unless ``begin_update``
        names one."""
        self._step: VerlStepPlan | None = None
        self.microbatches_run = 0
        """Training micro-batch forwards since :meth:`begin_update`."""
        for i, layer in enumerate(adapter.layers):
            layer.register_forward_pre_hook(self._pre_hook(i), prepend=True, with_kwargs=True)

    def begin_update(self, step: VerlStepPlan, optimizer: Any = None) -> int:
        """Move experts to ``step.plan.home`` (collective over the EP group) and arm the per-micro-batch
        plan and replay checks. Returns the experts this rank's group moved."""
        optimizer = self.optimizer if optimizer is None else optimizer
        if optimizer is None and self.adapter.grads_in_ddp_buffers():
            raise ValueError(
                "VerlActorHook: the actor's expert rows are in Megatron DDP's gradient buffers (a training "
                "engine), but no optimizer was given: its master weights and moments would stay behind when "
                "experts move; pass the engine's optimizer (VerlActorHook(adapter, engine.optimizer))"
            )
        moved = int(self.adapter.apply_placement(step.plan.home, optimizer))
        self._step, self.microbatches_run = step, 0
        return moved

    def end_update(self) -> None:
        """Back to home-only routing; checks stop."""
        self._step = None
        self.adapter.clear_microbatch()

    def _pre_hook(self, layer: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            step = self._step
            if step is None:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            if layer == 0:
                self.adapter.set_microbatch(step.plan, self.microbatches_run % step.num_microbatches)
                self.microbatches_run += 1
            num_tokens = (
                int(hidden.shape[0]) * int(hidden.shape[1]) if hidden.ndim == 3 else int(hidden.shape[0])
            )
            check_replay_targets([module.router.router_replay], num_tokens, first_layer=layer)

        return hook


@contextlib.contextmanager
def verl_cpu_patches() -> Iterator[None]:
    """verl 0.9.1 on a machine without CUDA: ``router_replay_utils`` picks its device at import
    (``device_name = get_device_name()``) and falls back to ``cuda`` when no accelerator is found, so
    ``set_router_replay_data`` would move the targets to a device that does not exist; this names the CPU
    for the block. Does nothing when CUDA is available."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    from verl.utils.megatron import router_replay_utils

    saved = router_replay_utils.device_name
    router_replay_utils.device_name = "cpu"
    try:
        yield
    finally:
        router_replay_utils.device_name = saved

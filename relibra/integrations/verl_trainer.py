"""Turning ReLibra on in verl's trainer: a driver mixin for ``RayPPOTrainer``, a worker class factory.

verl 0.9.1's ``RayPPOTrainer.fit`` (``verl/trainer/ppo/ray_trainer.py``) is one long loop; the two points
the hooks need are methods it calls once per step, so the supported way in is to extend those methods:

* :class:`ReLibraTrainerMixin`, listed before ``RayPPOTrainer``
  (``class Trainer(ReLibraTrainerMixin, RayPPOTrainer)``): its ``_balance_batch`` runs verl's, then
  :meth:`VerlReLibraHook.after_rollout` (planning starts while ``fit`` computes rewards and log
  probabilities); its ``_update_actor`` calls :meth:`VerlReLibraHook.before_update` (the batch reordered
  for the plan), puts the :class:`~relibra.integrations.verl.VerlStepPlan` into ``batch.meta_info`` under
  :data:`STEP_KEY`, then runs verl's ``_update_actor``. verl turns ``meta_info`` into non-tensor entries
  of the ``TensorDict`` it sends (``DataProto.to_tensordict``), and its dispatch hands every
  data-parallel chunk those entries (``dispatch_nd_compute_dataproto``), so each actor rank receives the
  plan with its samples.
* :func:`relibra_actor_worker`: a subclass of verl's actor worker (``ActorRolloutRefWorker``,
  ``verl/workers/engine_workers.py``) whose ``update_actor`` reads the plan from its data
  (:func:`take_step_plan`) and runs verl's update between :meth:`VerlActorHook.begin_update` and
  :meth:`VerlActorHook.end_update`. verl's dispatch registration of ``update_actor`` (``@register``, kept
  as a function attribute) is carried over, so the worker group exposes the method unchanged.
* :func:`relibra_megatron_engine`: a subclass of verl's Megatron engine (``MegatronEngine``,
  ``verl/workers/engine/megatron/transformer_impl.py``) that builds the actor with ReLibra's physical MoE
  layers. Its ``_build_tf_config`` runs verl's, then puts
  :func:`~relibra.integrations.mbridge.physical_bridge` of verl's mbridge bridge in ``self.bridge`` (and
  its config in ``self.tf_config``), so that verl's ``_build_megatron_module`` builds the model through
  the physical bridge's ``get_model`` (``make_megatron_module``; before the DDP wrap) and loads the
  checkpoint through its ``load_weights`` into the static placement's home rows; then its
  ``_build_megatron_module`` attaches the :class:`~relibra.megatron.adapter.MegatronPlanAdapter`
  (:func:`~relibra.integrations.mbridge.physical_adapter`, in ``self.relibra_adapter``), whose placement
  load and export follow from then on. Only verl's mbridge path: ``vanilla_mbridge=false`` (Megatron-Bridge's
  ``load_hf_weights``, its own name registry) is refused by name.

Refused, naming the key (:func:`check_trainer_config`, besides :func:`check_verl_config`):
``trainer.balance_batch=false`` (``fit`` then never calls ``_balance_batch``, so no plan would start),
``trainer.critic_warmup`` above 0 (warm-up steps skip ``_update_actor`` and would leave their plans
unused), ``actor_rollout_ref.actor.use_prefix_grouper=true`` (prefix sharing needs a prompt's samples on
one rank; the plan places samples itself). A step plan that is missing where one is due, or a worker
without its :class:`VerlActorHook`, is an error, never a silent update without the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relibra.integrations.verl import (
    MEGATRON,
    VerlActorHook,
    VerlConfigError,
    VerlReLibraHook,
    VerlStepPlan,
    _get,
    check_verl_config,
)
from relibra.megatron.physical import PhysicalExpertMap

__all__ = [
    "STEP_KEY",
    "ReLibraTrainerMixin",
    "check_trainer_config",
    "relibra_actor_worker",
    "relibra_megatron_engine",
    "take_step_plan",
]

STEP_KEY = "relibra_step_plan"
"""The ``meta_info`` / ``TensorDict`` key the step plan travels under from the driver to the actor."""


def check_trainer_config(config: Mapping[str, Any]) -> None:
    """Refuse the ``RayPPOTrainer`` settings the mixin cannot honour (module doc), naming the key; then
    :func:`check_verl_config`."""
    if _get(config, "trainer.balance_batch", True) is not True:
        raise VerlConfigError(
            "trainer.balance_batch=false: RayPPOTrainer.fit then never calls _balance_batch, where the "
            "mixin submits the batch's routes; set true (the plan reorders the batch anyway)"
        )
    warmup = _get(config, "trainer.critic_warmup", 0)
    if warmup not in (0, None):
        raise VerlConfigError(
            f"trainer.critic_warmup={warmup!r}: warm-up steps skip _update_actor, so their plans would never "
            "be applied; set 0"
        )
    if _get(config, "actor_rollout_ref.actor.use_prefix_grouper", False) is True:
        raise VerlConfigError(
            "actor_rollout_ref.actor.use_prefix_grouper=true: prefix sharing needs each prompt's samples on "
            "one rank, but the plan places every sample itself; set false"
        )
    check_verl_config(config)


class ReLibraTrainerMixin:
    """List before ``RayPPOTrainer``; call :meth:`enable_relibra` before ``fit`` (module doc)."""

    _relibra_hook: VerlReLibraHook | None = None
    _relibra_key: int | None = None

    def enable_relibra(self, hook: VerlReLibraHook) -> None:
        """Plan every step with ``hook`` (built from the same verl config: ``hook.from_verl_config``)."""
        check_trainer_config(self.config)  # type: ignore[attr-defined]
        self._relibra_hook, self._relibra_key = hook, None

    def _relibra(self) -> VerlReLibraHook:
        if self._relibra_hook is None:
            raise RuntimeError(
                f"{type(self).__name__}: ReLibra is mixed in but not enabled; call enable_relibra(hook) "
                "before fit()"
            )
        return self._relibra_hook

    def _balance_batch(self, batch: Any, metrics: Any, *args: Any, **kwargs: Any) -> None:
        hook = self._relibra()
        if self._relibra_key is not None:
            raise RuntimeError(
                f"the plan of the previous step (batch {self._relibra_key}) was never used by _update_actor"
            )
        super()._balance_batch(batch, metrics, *args, **kwargs)  # type: ignore[misc]
        self._relibra_key = hook.after_rollout(batch)

    def _update_actor(self, batch: Any) -> Any:
        hook, key = self._relibra(), self._relibra_key
        if key is None:
            raise RuntimeError(
                "_update_actor without a plan: _balance_batch did not run this step (trainer.balance_batch)"
            )
        self._relibra_key = None
        step = hook.before_update(batch, key)
        batch.meta_info[STEP_KEY] = step
        try:
            return super()._update_actor(batch)  # type: ignore[misc]
        finally:
            batch.meta_info.pop(STEP_KEY, None)


# ------------------------------------------------------------------------------------- worker side
def take_step_plan(data: Any) -> VerlStepPlan:
    """The step plan in an actor rank's ``TensorDict`` (verl's ``update_actor`` input). Refuses data
    without one.

    The entry is left in place: the chunks verl's dispatch splitter makes are locked ``TensorDict`` views,
    and verl's engine reads its non-tensor entries by name (``tu.get_non_tensor_data``), so an entry it
    does not know is carried along unread, as the driver's other ``meta_info`` keys are.
    """
    from verl.utils import tensordict_utils as tu

    step = tu.get(data, key=STEP_KEY, default=None)
    if not isinstance(step, VerlStepPlan):
        raise RuntimeError(
            f"update_actor received no ReLibra step plan under {STEP_KEY!r} (got {type(step).__name__}): "
            "the driver must run ReLibraTrainerMixin; refusing to train without the plan"
        )
    return step


def relibra_actor_worker(base: type, hook_of: Callable[[Any], VerlActorHook | None]) -> type:
    """A subclass of verl's actor worker ``base`` whose ``update_actor`` trains under the carried plan.

    ``hook_of(worker)``: the rank's :class:`VerlActorHook` (None: refused), e.g.
    ``VerlActorHook(engine.relibra_adapter, engine.optimizer)`` over the engine
    :func:`relibra_megatron_engine` built (docs/integrations.md).
    """
    update: Callable[..., Any] = base.update_actor  # type: ignore[attr-defined]

    @functools.wraps(update)  # keeps verl's @register attribute: the worker group dispatches it as before
    def update_actor(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        step = take_step_plan(data)
        hook = hook_of(self)
        if hook is None:
            raise RuntimeError(
                f"{type(self).__name__}: a ReLibra step plan arrived but this rank has no VerlActorHook "
                "(build the actor with ReLibra's MoE layers and a MegatronPlanAdapter)"
            )
        hook.begin_update(step)
        try:
            return update(self, data, *args, **kwargs)
        finally:
            hook.end_update()

    return type(f"ReLibra{base.__name__}", (base,), {"update_actor": update_actor})


def relibra_megatron_engine(
    base: type, expert_map_of: Callable[[Any], PhysicalExpertMap], moe_layers: Sequence[int] | None = None
) -> type:
    """A subclass of verl's Megatron engine ``base`` that builds the physical model (module doc).

    ``expert_map_of(engine)``: the rank's :class:`~relibra.megatron.physical.PhysicalExpertMap` (``E`` of the
    checkpoint, ``G`` = the engine's EP size, ``r`` replica slots), read when the config is built.
    ``moe_layers``: the checkpoint layer of each MoE layer when dense layers come first (None: every layer
    is a MoE layer), as :func:`~relibra.integrations.mbridge.physical_bridge` takes it.
    """
    from relibra.integrations.mbridge import physical_adapter, physical_bridge

    build_config: Callable[..., Any] = base._build_tf_config  # type: ignore[attr-defined]
    build_module: Callable[..., Any] = base._build_megatron_module  # type: ignore[attr-defined]

    def _build_tf_config(self: Any) -> None:
        build_config(self)
        if not self.vanilla_bridge:
            raise VerlConfigError(
                f"{MEGATRON}.vanilla_mbridge=false: ReLibra builds and loads the physical model through "
                "mbridge only (Megatron-Bridge's load_hf_weights is not wired); set it to true"
            )
        expert_map = self.relibra_expert_map = expert_map_of(self)
        self.relibra_adapter = None

        def placement() -> Any:
            # NOTE: verl loads the checkpoint inside _build_megatron_module, before the adapter exists;
            # the adapter starts from the static placement, so that is the placement of that load.
            adapter = self.relibra_adapter
            if adapter is None:
                count = int(self.bridge.config.num_layers) if moe_layers is None else len(moe_layers)
                return expert_map.static_phy2log(count)
            return adapter.phy2log

        self.bridge = physical_bridge(self.bridge, expert_map, placement, moe_layers)
        self.tf_config = self.bridge.config

    def _build_megatron_module(self: Any) -> Any:
        module = build_module(self)
        self.relibra_adapter = physical_adapter(module, self.relibra_expert_map)
        return module

    return type(
        f"ReLibra{base.__name__}",
        (base,),
        {"_build_tf_config": _build_tf_config, "_build_megatron_module": _build_megatron_module},
    )

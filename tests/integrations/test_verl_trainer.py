"""ReLibra turned on in verl's trainer: ``ReLibraTrainerMixin`` over verl's own ``RayPPOTrainer`` methods.

``RayPPOTrainer`` cannot be constructed without Ray worker groups and GPUs, so the trainer object is made
without its ``__init__`` and given what the two methods read: verl's generated Megatron trainer config and
a stand-in for the actor worker group (its dispatch info and an ``update_actor`` that splits the
``TensorDict`` with verl's own nd-dispatch splitter and hands each chunk to a worker). The driver loop is
the part of ``RayPPOTrainer.fit`` between rollout and update, in its order: ``_balance_batch``, then the
rewards and log-probabilities (here: nothing changes the batch's rows), then ``_update_actor``. verl's real
``_balance_batch`` and ``_update_actor`` run through the mixin; the worker is
:func:`relibra_actor_worker` over a class whose ``update_actor`` carries verl's ``@register`` dispatch.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install '.[verl]' (docs/integrations.md)")

import torch

from relibra.control.config import ControlPlaneConfig
from relibra.integrations.verl import VerlConfigError, VerlReLibraHook, VerlStepPlan
from relibra.integrations.verl_trainer import (
    STEP_KEY,
    ReLibraTrainerMixin,
    check_trainer_config,
    relibra_actor_worker,
    relibra_megatron_engine,
)
from relibra.planners.compose import relibra
from relibra.planners.reorder.config import AnnealConfig
from tests.builders import make_cost
from tests.integrations.verl_builders import verl_trainer_config
from tests.trace.rl_builders import sample_routes, verl_batch

pytestmark = pytest.mark.verl

WORLD, MICRO, PROMPTS, N = 4, 2, 8, 2
NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2
MAX_PROMPT, MAX_RESPONSE = 8, 24


def verl_config():  # type: ignore[no-untyped-def]
    return verl_trainer_config(WORLD, MICRO, PROMPTS, N)


def rollout(rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """A rollout batch as verl's agent loop returns it (prompt left-padded, response right-padded, the
    rollout's routes in ``routed_experts``), and each sample's recorded routes."""
    from verl.protocol import DataProto

    bs = PROMPTS * N
    prompts = rng.integers(2, MAX_PROMPT + 1, bs).tolist()
    responses = rng.integers(3, MAX_RESPONSE + 1, bs).tolist()
    recorded = sample_routes(
        rng, [p + r - 1 for p, r in zip(prompts, responses, strict=True)], NUM_LAYERS, NUM_EXPERTS, TOP_K
    )
    routed, mask = verl_batch(recorded, prompts, MAX_PROMPT, MAX_RESPONSE)
    attention = torch.tensor(mask)
    ids = torch.tensor(rng.integers(1, 50, attention.shape)) * attention
    batch = DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": torch.clamp(attention.cumsum(dim=1) - 1, min=0),
            "response_mask": attention[:, MAX_PROMPT:],
            "routed_experts": torch.tensor(routed, dtype=torch.int16),
        }
    )
    return batch, recorded


class RecordingActorHook:
    """Stands in for a rank's :class:`VerlActorHook` (which needs the Megatron model): records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def begin_update(self, step: VerlStepPlan, optimizer: object = None) -> int:
        self.calls.append(("begin", step))
        return 0

    def end_update(self) -> None:
        self.calls.append(("end", None))


def base_worker_class() -> type:
    """An actor worker whose ``update_actor`` is registered for verl's nd dispatch, as
    ``ActorRolloutRefWorker.update_actor`` is, and records the rows and keys it trains on."""
    from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register

    class Worker:
        def __init__(self) -> None:
            self.hook = RecordingActorHook()
            self.seen: list[dict] = []

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
        def update_actor(self, data):  # type: ignore[no-untyped-def]
            from verl.utils import tensordict_utils as tu

            self.seen.append(
                {
                    "keys": set(data.keys()),
                    "ids": [row.tolist() for row in data["input_ids"].unbind()],
                    "hook_calls": len(self.hook.calls),
                }
            )
            return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": 0.5}})

    return Worker


class WorkerGroup:
    """The actor worker group's parts ``_balance_batch`` and ``_update_actor`` use."""

    def __init__(self, workers: list) -> None:  # type: ignore[type-arg]
        self.workers = workers
        self._dispatch_info = {"actor": list(range(len(workers)))}

    def update_actor(self, data):  # type: ignore[no-untyped-def]
        from verl.single_controller.base.decorator import _split_args_kwargs_data_proto

        (chunks,), _ = _split_args_kwargs_data_proto(len(self.workers), data)
        outputs = [w.update_actor(c) for w, c in zip(self.workers, chunks, strict=True)]
        return outputs[0]


def make_trainer(config):  # type: ignore[no-untyped-def]
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    class Trainer(ReLibraTrainerMixin, RayPPOTrainer):
        pass

    trainer = object.__new__(Trainer)  # NOTE: RayPPOTrainer.__init__ needs Ray worker groups and GPUs
    trainer.config = config
    worker_cls = relibra_actor_worker(base_worker_class(), lambda worker: worker.hook)
    trainer.actor_rollout_wg = WorkerGroup([worker_cls() for _ in range(WORLD)])
    cost = make_cost(1, WORLD, NUM_EXPERTS, num_layers=NUM_LAYERS, top_k=TOP_K)
    hook = VerlReLibraHook.from_verl_config(
        config,
        relibra(2, reorder=AnnealConfig(locality=False)),
        cost.cluster,
        cost.model,
        cost=cost,
        config=ControlPlaneConfig(workers=0, warm_up=False),
    )
    return trainer, hook


def test_fit_order_plans_reorders_and_carries_the_plan_to_every_rank() -> None:
    config = verl_config()
    trainer, hook = make_trainer(config)
    rng = np.random.default_rng(4)
    batch, recorded = rollout(rng)
    try:
        trainer.enable_relibra(hook)
        metrics: dict = {}
        trainer._balance_batch(batch, metrics=metrics)  # verl's, then after_rollout
        assert "global_seqlen/min" in metrics, "verl's _balance_batch ran"
        balanced = batch.batch["input_ids"].clone()
        output = trainer._update_actor(batch)  # before_update, then verl's _update_actor
        with pytest.raises(RuntimeError, match="_update_actor without a plan"):
            trainer._update_actor(batch)
    finally:
        hook.close()
    assert output.meta_info["metrics"]["perf/mfu/actor"] == 0.5
    assert STEP_KEY not in batch.meta_info
    steps = []
    for g, worker in enumerate(trainer.actor_rollout_wg.workers):
        assert [c[0] for c in worker.hook.calls] == ["begin", "end"]
        (seen,) = worker.seen
        assert seen["hook_calls"] == 1, "verl's update ran between begin_update and end_update"
        assert STEP_KEY in seen["keys"], "the plan travels in the rank's TensorDict"
        step = worker.hook.calls[0][1]
        steps.append(step)
        # this rank trains exactly the samples the plan put on it, in the plan's micro-batch order
        rows = step.order[g * step.num_microbatches * MICRO : (g + 1) * step.num_microbatches * MICRO]
        assert (step.plan.sample_gpu[rows] == g).all()
        want = [balanced[s][balanced[s] != 0].tolist() for s in rows]
        assert seen["ids"] == want
    assert all(np.array_equal(s.order, steps[0].order) for s in steps), "every rank gets the same plan"
    assert sorted(steps[0].order.tolist()) == list(range(PROMPTS * N))
    # the plan counts every recorded route and each sample's filled last row, at every layer
    tokens = sum(r.shape[0] for r in recorded) + PROMPTS * N
    assert int(steps[0].plan.load.sum()) == tokens * NUM_LAYERS * TOP_K


def test_mixin_refuses_what_it_cannot_honour() -> None:
    from omegaconf import OmegaConf

    for key, value, match in (
        ("trainer.balance_batch", False, "trainer.balance_batch=false"),
        ("trainer.critic_warmup", 2, "trainer.critic_warmup=2"),
        ("actor_rollout_ref.actor.use_prefix_grouper", True, "use_prefix_grouper=true"),
        ("actor_rollout_ref.actor.use_dynamic_bsz", True, "use_dynamic_bsz"),
    ):
        cfg = verl_config()
        OmegaConf.update(cfg, key, value, force_add=True)
        with pytest.raises(VerlConfigError, match=match):
            check_trainer_config(cfg)
    check_trainer_config(verl_config())


def test_trainer_without_enable_and_worker_without_plan_are_refused() -> None:
    config = verl_config()
    trainer, hook = make_trainer(config)
    hook.close()
    batch, _ = rollout(np.random.default_rng(1))
    with pytest.raises(RuntimeError, match="enable_relibra"):
        trainer._balance_batch(batch, metrics={})
    worker = trainer.actor_rollout_wg.workers[0]
    from verl.utils import tensordict_utils as tu

    with pytest.raises(RuntimeError, match="no ReLibra step plan"):
        worker.update_actor(tu.get_tensordict(tensor_dict={"x": torch.zeros(2)}, non_tensor_dict={}))
    assert worker.seen == [] and worker.hook.calls == []


def test_worker_factory_keeps_verls_dispatch_registration() -> None:
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cls = relibra_actor_worker(ActorRolloutRefWorker, lambda worker: None)
    assert issubclass(cls, ActorRolloutRefWorker)
    assert getattr(cls.update_actor, MAGIC_ATTR) == getattr(ActorRolloutRefWorker.update_actor, MAGIC_ATTR)


def test_engine_subclass_extends_the_steps_verls_megatron_engine_runs() -> None:
    """The two methods :func:`relibra_megatron_engine` extends are the ones verl 0.9.1's engine runs, in
    that order, and on its mbridge path the module step builds and loads through ``self.bridge`` (the
    engine itself needs CUDA; its steps are run on CPU over a stand-in in test_mbridge_model.py)."""
    import inspect

    from verl.workers.engine.megatron.transformer_impl import MegatronEngine, MegatronEngineWithLMHead

    from relibra.megatron.physical import PhysicalExpertMap

    for base in (MegatronEngine, MegatronEngineWithLMHead):
        cls = relibra_megatron_engine(base, lambda engine: PhysicalExpertMap(8, 2, 1))
        assert issubclass(cls, base) and cls.__name__ == f"ReLibra{base.__name__}"
        assert cls._build_tf_config is not base._build_tf_config
        assert cls._build_megatron_module is not base._build_megatron_module
    init = inspect.getsource(MegatronEngine.initialize)
    assert init.index("self._build_tf_config()") < init.index("self._build_megatron_module()")
    config = inspect.getsource(MegatronEngine._build_tf_config)
    assert "self.bridge = bridge" in config and "self.tf_config = tf_config" in config
    module = inspect.getsource(MegatronEngine._build_megatron_module)
    assert "bridge=self.bridge" in module and "self.bridge.load_weights(module" in module

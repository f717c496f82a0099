"""verl's own Megatron trainer config with the keys the hook needs, for the tests that have verl."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def verl_trainer_config(world: int, micro: int, prompts: int, n: int) -> Any:
    """``_generated_ppo_megatron_trainer.yaml`` of the installed verl with R3 replay, ``world`` GPUs on one
    node (the EP group), ``micro`` samples per GPU per micro-batch, ``prompts`` prompts per mini-batch and
    ``n`` rollouts each (docs/integrations.md)."""
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
    for key, value in {
        "actor_rollout_ref.actor.megatron.router_replay.mode": "R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.actor.ppo_mini_batch_size": prompts,
        "actor_rollout_ref.rollout.n": n,
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size": world,
        "actor_rollout_ref.actor.megatron.vanilla_mbridge": True,
        "trainer.nnodes": 1,
        "trainer.n_gpus_per_node": world,
    }.items():
        OmegaConf.update(cfg, key, value)
    return cfg

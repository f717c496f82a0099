"""The verl hook's parts that need no process group: config checks, the fixed-count layout, the batch
order, planning with a given layout, and the replay check (with megatron-core's and verl's RouterReplay)."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.control.config import ControlPlaneConfig
from relibra.control.plane import ControlPlane
from relibra.integrations.layout import fixed_count_layout
from relibra.integrations.verl import (
    ReplayFallbackError,
    VerlConfigError,
    VerlReLibraHook,
    VerlSettings,
    check_replay_targets,
    check_verl_config,
    step_order,
)
from relibra.planners.compose import relibra
from relibra.planners.protocols import static_placement
from relibra.planners.reorder.config import AnnealConfig
from relibra.workload import microbatch_loads, sample_context
from tests.builders import make_cost

GOOD = {
    "trainer": {"nnodes": 1, "n_gpus_per_node": 4},
    "actor_rollout_ref": {
        "rollout": {"enable_rollout_routing_replay": True, "n": 2},
        "actor": {
            "strategy": "megatron",
            "use_dynamic_bsz": False,
            "shuffle": False,
            "ppo_micro_batch_size_per_gpu": 2,
            "ppo_mini_batch_size": 8,
            "ppo_epochs": 1,
            "megatron": {
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1,
                "virtual_pipeline_model_parallel_size": None,
                "context_parallel_size": 1,
                "expert_model_parallel_size": 4,
                "expert_tensor_parallel_size": None,
                "use_remove_padding": True,
                "vanilla_mbridge": True,
                "router_replay": {"mode": "R3"},
                "override_transformer_config": {"recompute_granularity": None},
            },
        },
    },
}


def _with(key: str, value: object) -> dict:
    cfg = copy.deepcopy(GOOD)
    node = cfg
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    return cfg


def test_check_verl_config_accepts_the_supported_setting() -> None:
    assert check_verl_config(GOOD) == VerlSettings(
        num_gpus=4, samples_per_microbatch=2, mini_batch_size=16, epochs=1
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("actor_rollout_ref.actor.use_dynamic_bsz", True),
        ("actor_rollout_ref.actor.shuffle", True),
        ("actor_rollout_ref.actor.strategy", "fsdp"),
        ("actor_rollout_ref.actor.megatron.router_replay.mode", "R2"),
        ("actor_rollout_ref.actor.megatron.router_replay.mode", "disabled"),
        ("actor_rollout_ref.rollout.enable_rollout_routing_replay", False),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", None),
        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 2),
        ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", 2),
        ("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", 2),
        ("actor_rollout_ref.actor.megatron.context_parallel_size", 2),
        ("actor_rollout_ref.actor.megatron.expert_model_parallel_size", 2),
        ("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size", 2),
        ("actor_rollout_ref.actor.megatron.use_remove_padding", False),
        ("actor_rollout_ref.actor.megatron.pad_to_length", True),
        ("actor_rollout_ref.actor.megatron.override_transformer_config.fp8", "e4m3"),
        ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity", "full"),
        ("actor_rollout_ref.actor.megatron.vanilla_mbridge", False),
        ("actor_rollout_ref.actor.megatron.use_distributed_optimizer", False),
        ("actor_rollout_ref.actor.optim.use_precision_aware_optimizer", True),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", 3),
        ("trainer.nnodes", 0),
    ],
)
def test_check_verl_config_names_the_key_it_cannot_honour(key: str, value: object) -> None:
    with pytest.raises(VerlConfigError, match="^" + re.escape(key) + "="):
        check_verl_config(_with(key, value))


def test_check_verl_config_on_verls_own_config() -> None:
    """verl's generated Megatron trainer config: refused as shipped (replay disabled), accepted once the
    hook's keys are set."""
    verl = pytest.importorskip(
        "verl", reason="verl is not installed: pip install '.[verl]' (docs/integrations.md)"
    )
    from pathlib import Path

    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
    with pytest.raises(
        VerlConfigError, match=r"actor_rollout_ref\.actor\.megatron\.router_replay\.mode='disabled'"
    ):
        check_verl_config(cfg)
    for key, value in {
        "actor_rollout_ref.actor.megatron.router_replay.mode": "R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size": 8,
        "actor_rollout_ref.actor.megatron.vanilla_mbridge": True,
    }.items():
        OmegaConf.update(cfg, key, value)
    assert check_verl_config(cfg).num_gpus == 8


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 500), min_size=1, max_size=6),
    gpus=st.integers(1, 4),
    k=st.integers(1, 3),
    mbs=st.integers(1, 3),
)
def test_fixed_count_layout_fills_every_gpu_and_microbatch(tokens, gpus, k, mbs) -> None:  # type: ignore[no-untyped-def]
    lens = np.resize(np.asarray(tokens), gpus * k * mbs)
    layout = fixed_count_layout(lens, gpus, k)
    held = np.zeros((gpus, mbs), dtype=int)
    np.add.at(held, (layout.sample_gpu, layout.sample_mb), 1)
    assert (held == k).all() and layout.num_microbatches == mbs
    order = step_order(layout.sample_gpu, layout.sample_mb, gpus, k)
    # verl's contiguous chunks and micro-batches of the reordered batch are the layout's (gpu, mb) groups
    chunks = order.reshape(gpus, mbs, k)
    for g in range(gpus):
        for m in range(mbs):
            assert (layout.sample_gpu[chunks[g, m]] == g).all() and (
                layout.sample_mb[chunks[g, m]] == m
            ).all()


def test_fixed_count_layout_balances_tokens_and_refuses_partial_batches() -> None:
    lens = np.array([100, 90, 80, 70, 10, 9, 8, 7])
    layout = fixed_count_layout(lens, 2, 2)
    per = np.zeros((2, 2))  # [mb, gpu] tokens
    np.add.at(per, (layout.sample_mb, layout.sample_gpu), lens)
    # snake dealing evens the micro-batches; count-bounded LPT keeps each one's spread under its longest
    # sample (mb 0 holds 100, 70, 10, 7: 107 / 80 is its best equal-count split)
    assert per.sum(axis=1).tolist() == [187, 187]
    assert sorted(per[0].tolist()) == [80, 107] and sorted(per[1].tolist()) == [89, 98]
    with pytest.raises(ValueError, match="needs a multiple of 4 samples"):
        fixed_count_layout(lens[:6], 2, 2)
    with pytest.raises(ValueError, match=r"puts 3 samples on GPU 0 in micro-batch 0"):
        step_order(np.array([0, 0, 0, 1]), np.zeros(4, int), 2, 2)


def test_seal_with_a_layout_plans_as_the_planner_does_on_it() -> None:
    """The control plane planning a given layout equals the planner on the context of that layout."""
    rng = np.random.default_rng(4)
    cost = make_cost(1, 4, 8, num_layers=2, top_k=2)
    tokens = rng.integers(20, 60, size=16)
    counts = np.stack(  # [S, L, E]: each sample's k * tokens routed slots, experts 0 and 1 hot
        [rng.multinomial(2 * t, np.r_[6, 6, np.ones(6)] / 18, size=2) for t in tokens]
    ).astype(np.int32)
    layout = fixed_count_layout(tokens, 4, 2)
    planner = relibra(2, reorder=AnnealConfig(locality=False))
    cp = ControlPlane.from_planner(
        planner, cost.cluster, cost.model, cost, ControlPlaneConfig(workers=0, warm_up=False)
    )
    try:
        cp.submit(counts, tokens)
        got = cp.plans(cp.seal(layout=layout))
    finally:
        cp.close()
    ctx = sample_context(
        batch=0,
        counts=counts,
        sample_tokens=tokens.astype(np.int64),
        sample_gpu=layout.sample_gpu,
        sample_mb=layout.sample_mb,
        load=microbatch_loads(counts, layout.sample_gpu, layout.sample_mb, layout.num_microbatches, 4),
        cluster=cost.cluster,
        model=cost.model,
        cost=cost,
        prev_home=static_placement(2, 8, 4),
    )
    want = planner.plan(ctx)
    np.testing.assert_array_equal(got.home, want.home)
    np.testing.assert_array_equal(got.assign, want.assign)
    np.testing.assert_array_equal(got.load, want.load)
    np.testing.assert_array_equal(got.sample_gpu, want.sample_gpu)
    # the delivered plan may rename GPUs (relabel_for) but keeps K samples on every (GPU, micro-batch)
    assert step_order(got.sample_gpu, layout.sample_mb, 4, 2).shape == (16,)


def test_hook_refuses_a_planner_that_moves_samples() -> None:
    cost = make_cost(1, 4, 8, num_layers=2, top_k=2)
    settings_ = check_verl_config(GOOD)
    with pytest.raises(VerlConfigError, match=r"runs the locality round.*ppo_micro_batch_size_per_gpu=2"):
        VerlReLibraHook(
            relibra(2, reorder=AnnealConfig(locality=True)), settings_, cost.cluster, cost.model, cost
        )
    with pytest.raises(VerlConfigError, match=r"trainer.nnodes \* trainer.n_gpus_per_node = 4 GPUs"):
        bigger = make_cost(1, 8, 8, num_layers=2, top_k=2)
        VerlReLibraHook(
            relibra(2, reorder=AnnealConfig(locality=False)), settings_, bigger.cluster, bigger.model
        )


# --- the replay check ---------------------------------------------------------------------------------
def _replay_classes(which: str):  # type: ignore[no-untyped-def]
    if which == "verl":
        pytest.importorskip(
            "verl", reason="verl is not installed: pip install '.[verl]' (docs/integrations.md)"
        )
        from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    else:
        pytest.importorskip(
            "megatron.core", reason="megatron-core is not installed: pip install '.[megatron]'"
        )
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    return RouterReplay, RouterReplayAction


@pytest.mark.parametrize("which", ["megatron", "verl"])
def test_replay_check_refuses_every_silent_fallback(which: str) -> None:
    import torch

    replay_cls, action = _replay_classes(which)
    inst = replay_cls()
    with pytest.raises(ReplayFallbackError, match="layer 3: router replay action is None"):
        check_replay_targets([inst], 5, first_layer=3)
    inst.set_router_replay_action(action.REPLAY_FORWARD)
    with pytest.raises(ReplayFallbackError, match="REPLAY_FORWARD without targets"):
        check_replay_targets([inst], 5)
    inst.set_target_indices(torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ReplayFallbackError, match="replay targets for 4 tokens, the micro-batch has 5"):
        check_replay_targets([inst], 5)
    check_replay_targets([inst], 4)  # replays: accepted
    with pytest.raises(ReplayFallbackError, match="has no RouterReplay"):
        check_replay_targets([None], 4)
    other = _replay_classes("megatron" if which == "verl" else "verl")[1]
    inst.set_router_replay_action(other.REPLAY_FORWARD)  # the other framework's enum: never matches
    with pytest.raises(ReplayFallbackError, match="would compute native routes"):
        check_replay_targets([inst], 4)


def test_replay_check_lifts_verls_r3_mask() -> None:
    import torch

    replay_cls, action = _replay_classes("verl")
    inst = replay_cls()
    inst.set_router_replay_action(action.REPLAY_FORWARD)
    inst.set_target_indices(
        torch.zeros(3, 2, dtype=torch.long), replay_mask=torch.tensor([True, True, False])
    )
    check_replay_targets([inst], 3)
    assert inst.target_replay_mask is None and inst.replay_backward_mask_list[-1] is None


def test_megatron_replay_api_refuses_a_patched_replay() -> None:
    """relibra.megatron.replay sets megatron-core's actions, which a trainer's RouterReplay ignores: it
    refuses such instances instead of letting the layer route natively."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install '.[megatron]'")
    from types import SimpleNamespace

    from relibra.megatron.replay import replay_instances

    class RouterReplay:  # stands for a trainer's own class of the same name
        pass

    with pytest.raises(ValueError, match=r"not megatron-core's RouterReplay.*route natively"):
        replay_instances([SimpleNamespace(router_replay=RouterReplay())])


class _Batch:
    """The two parts of verl's ``DataProto`` the driver hook uses: ``batch`` (tensors) and ``reorder``."""

    def __init__(self, tensors: dict) -> None:
        self.batch = tensors

    def reorder(self, idx) -> None:  # type: ignore[no-untyped-def]
        self.batch = {k: v[idx] for k, v in self.batch.items()}


def test_driver_hook_orders_the_batch_and_fills_the_last_rows() -> None:
    import torch

    from tests.trace.rl_builders import sample_routes, verl_batch

    rng = np.random.default_rng(2)
    prompts = rng.integers(1, 6, 16).tolist()
    responses = rng.integers(4, 30, 16).tolist()
    recorded = sample_routes(rng, [p + r - 1 for p, r in zip(prompts, responses, strict=True)], 2, 8, 2)
    routed, mask = verl_batch(recorded, prompts, 6, 30)
    cost = make_cost(1, 4, 8, num_layers=2, top_k=2)
    hook = VerlReLibraHook(
        relibra(2, reorder=AnnealConfig(locality=False)),
        check_verl_config(GOOD),
        cost.cluster,
        cost.model,
        cost,
        config=ControlPlaneConfig(workers=0, warm_up=False),
    )
    try:
        batch = _Batch({"routed_experts": torch.tensor(routed), "attention_mask": torch.tensor(mask)})
        key = hook.after_rollout(batch)
        step = hook.before_update(batch, key)
        # rows changed between the two calls: refused
        again = _Batch({"routed_experts": torch.tensor(routed), "attention_mask": torch.tensor(mask)})
        key2 = hook.after_rollout(again)
        again.reorder(torch.arange(15, -1, -1))
        with pytest.raises(ValueError, match="rows changed between after_rollout and before_update"):
            hook.before_update(again, key2)
    finally:
        hook.close()
    assert step.num_microbatches == 2 and sorted(step.order.tolist()) == list(range(16))
    per_rank = step.order.reshape(4, 2, 2)  # [rank, micro-batch, sample]
    assert (step.plan.sample_gpu[per_rank] == np.arange(4)[:, None, None]).all()
    got = batch.batch["routed_experts"].numpy()
    for i, s in enumerate(step.order):
        real = np.flatnonzero(batch.batch["attention_mask"][i].numpy())
        np.testing.assert_array_equal(got[i, real[:-1]], recorded[s])
        np.testing.assert_array_equal(got[i, real[-1]], np.tile(np.arange(2), (2, 1)))  # the filler


@pytest.mark.parametrize(
    ("layers", "k", "moe_layers", "message"),
    [
        (2, 3, None, r"routed_experts has top-k 3 \(its last axis\) but model .* top_k=2"),
        (
            3,
            2,
            None,
            r"routed_experts has 3 MoE layers \(its layer axis \(2\)\) but model .* num_moe_layers=2",
        ),
        (3, 2, [0], r"routed_experts has 1 MoE layers \(the moe_layers given\)"),
    ],
)
def test_driver_hook_refuses_routes_of_another_shape_than_its_model(layers, k, moe_layers, message) -> None:
    import torch

    from relibra.trace.format import TraceFormatError
    from tests.trace.rl_builders import sample_routes, verl_batch

    rng = np.random.default_rng(3)
    prompts, responses = [3] * 16, [8] * 16
    recorded = sample_routes(rng, [p + r - 1 for p, r in zip(prompts, responses, strict=True)], layers, 8, k)
    routed, mask = verl_batch(recorded, prompts, 3, 8)
    cost = make_cost(1, 4, 8, num_layers=2, top_k=2)  # a top-2 model of 2 MoE layers
    hook = VerlReLibraHook(
        relibra(2, reorder=AnnealConfig(locality=False)),
        check_verl_config(GOOD),
        cost.cluster,
        cost.model,
        cost,
        moe_layers=moe_layers,
        config=ControlPlaneConfig(workers=0, warm_up=False),
    )
    try:
        batch = _Batch({"routed_experts": torch.tensor(routed), "attention_mask": torch.tensor(mask)})
        with pytest.raises(TraceFormatError, match=message):
            hook.after_rollout(batch)
    finally:
        hook.close()

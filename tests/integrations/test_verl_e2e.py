"""ReLibra inside verl, end to end on CPU: verl's own data path, the hooks, the Megatron adapter, 4 ranks.

The driver side runs in this process as ``RayPPOTrainer.fit`` would: a batch of 16 rollouts built the way
verl's agent loop builds it (its padding helpers, ``DataProto``, the routes the rollout side recorded -- the
plain model under megatron-core's ``RECORD``, every token but the last -- written into
``routed_experts``), ``VerlReLibraHook.after_rollout`` / ``before_update`` (a ReLibra plan from those
routes, the batch reordered, the step plan put into ``meta_info`` as ``ReLibraTrainerMixin`` does), then
verl's ``_update_actor`` data path: ``to_tensordict``, ``left_right_2_no_padding``, the DP chunks of its
dispatch (``chunk_tensordict``; each rank takes its step plan from its chunk), its mini-batch
iterator (``make_iterator``) and its micro-batching (``prepare_micro_batches``). Each of 4 forked gloo
ranks then trains its micro-batches as verl's Megatron engine does (``set_global_router_replay_action``,
``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data`` under verl's
``apply_router_replay_patch``) on two Megatron MoE models built alike: plain (static placement) and
ReLibra's (the adapter, driven by ``VerlActorHook``). Checks: the balanced layer's outputs and input,
expert, router and mixing gradients equal the plain layer's; every rank's per-expert loads equal the
plan's ``assign`` exactly; a layer whose replay targets are missing or set with the wrong enum is refused,
and a router that routes natively under a plan is refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install '.[megatron]'")
pytest.importorskip("verl", reason="verl is not installed: pip install '.[verl]' (docs/integrations.md)")

import torch

from relibra.control.config import ControlPlaneConfig
from relibra.executors.torch_executor import launch
from relibra.integrations.verl import VerlReLibraHook, VerlStepPlan
from relibra.integrations.verl_trainer import STEP_KEY
from relibra.megatron.planning import load_hardware, planning_specs
from relibra.planners.compose import relibra
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.replicate.greedy import GreedyConfig
from tests.integrations.verl_builders import verl_trainer_config

pytestmark = [pytest.mark.megatron, pytest.mark.verl, pytest.mark.slow]

WORLD, R = 4, 2
NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K = 2, 16, 8, 8, 2
MICRO, PROMPTS, N = 2, 8, 2
"""ppo_micro_batch_size_per_gpu, prompts per step, rollout.n: 16 samples, 2 micro-batches per rank."""
MAX_PROMPT, MAX_RESPONSE, VOCAB = 16, 40, 64
ATOL, RTOL = 2e-5, 1e-5
GRAD_RTOL = 1e-4
"""Float32 summation order differs between the plain and the physical model; a hot expert's weight gradient
sums about 500 tokens' contributions (the rollout's shared direction makes a few experts hot), so it is
compared at a relative 1e-4 (measured: 5e-5 at most), and an entry's rounding error follows the sizes of the
terms it sums, not its own: an entry near zero in a gradient whose largest entries are about 200 is compared
at 1e-4 of that largest entry (seen: -0.83096 against -0.83107 in a fresh verl venv, 2026-12-03)."""
REPO = Path(__file__).resolve().parents[2]


def verl_config():  # type: ignore[no-untyped-def]
    return verl_trainer_config(WORLD, MICRO, PROMPTS, N)


def embedding() -> torch.Tensor:
    """Token embeddings [VOCAB, H] shared by the rollout and every rank: random rows plus one shared
    direction (a topic every response shares), which makes a few experts hot at every layer."""
    gen = torch.Generator().manual_seed(11)
    return torch.randn(VOCAB, HIDDEN, generator=gen) + 1.5 * torch.randn(HIDDEN, generator=gen)


def record_rollout(rank: int, world: int, sequences: list[list[int]]) -> list[np.ndarray]:
    """The rollout side: the plain model (the policy's weights) runs each sequence and megatron-core's
    ``RouterReplay`` records its routes; as an inference engine, it keeps every token's route but the
    last one's (never run forward): int16 [len - 1, L, k] per sequence."""
    from relibra.megatron.model import TinyMoEModel, TinyMoESpec, init_expert_parallel
    from relibra.megatron.replay import recorded_routes, recording

    init_expert_parallel(world)
    model = TinyMoEModel(TinyMoESpec(NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, seed=3), world)
    embed, out = embedding(), []
    for tokens in sequences:
        with torch.no_grad(), recording(model.routers):
            model(embed[torch.tensor(tokens)])
        out.append(recorded_routes(model.routers)[:-1].astype(np.int16))
    return out


def rollout_batch(rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """16 rollouts as verl's agent loop returns them (``_postprocess``): the prompt left-padded, the
    response right-padded, the routes the rollout recorded (``[len - 1, L, k]``, :func:`record_rollout`,
    one forked process) at the first real position."""
    from verl.protocol import DataProto
    from verl.utils.torch_functional import pad_2d_list_to_length, pad_sequence_to_length

    bs = PROMPTS * N
    prompts = [rng.integers(1, VOCAB, int(rng.integers(8, MAX_PROMPT + 1))).tolist() for _ in range(bs)]
    responses = [rng.integers(1, VOCAB, int(rng.integers(12, MAX_RESPONSE + 1))).tolist() for _ in range(bs)]
    prompt_ids = torch.cat(
        [pad_sequence_to_length(torch.tensor([p]), MAX_PROMPT, 0, left_pad=True) for p in prompts]
    )
    response_ids = pad_2d_list_to_length(responses, 0, max_length=MAX_RESPONSE)
    prompt_mask = torch.cat(
        [
            pad_sequence_to_length(torch.ones(1, len(p), dtype=torch.long), MAX_PROMPT, 0, left_pad=True)
            for p in prompts
        ]
    )
    response_mask = pad_2d_list_to_length([[1] * len(r) for r in responses], 0, max_length=MAX_RESPONSE)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    routed = torch.zeros(bs, MAX_PROMPT + MAX_RESPONSE, NUM_LAYERS, TOP_K, dtype=torch.int16)
    recorded = launch(
        record_rollout, 1, [p + r for p, r in zip(prompts, responses, strict=True)], start_method="fork"
    )[0]
    for s, (p, rows) in enumerate(zip(prompts, recorded, strict=True)):
        start = MAX_PROMPT - len(p)
        routed[s, start : start + rows.shape[0]] = torch.from_numpy(rows)
    position_ids = torch.clamp(attention_mask.cumsum(dim=1) - 1, min=0)
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "routed_experts": routed,
        }
    )
    return batch, recorded


def verl_microbatches(batch):  # type: ignore[no-untyped-def]
    """verl's ``_update_actor`` data path down to each rank's micro-batches, as plain tensors per rank,
    and the step plan each rank's chunk carries (``ReLibraTrainerMixin`` puts it into ``meta_info``)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    from relibra.integrations.verl_trainer import take_step_plan

    td = left_right_2_no_padding(batch.to_tensordict())
    per_rank, steps = [], []
    for chunk in tu.chunk_tensordict(td, WORLD):  # dispatch_nd_compute_dataproto: rank g, chunk g
        steps.append(take_step_plan(chunk))
        mbs = []
        for mini in tu.make_iterator(
            chunk, len(chunk), epochs=1, seed=0, dataloader_kwargs={"shuffle": False}
        ):
            tu.assign_non_tensor(mini, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO)
            micro_batches, _ = prepare_micro_batches(mini)
            for mb in micro_batches:
                ids, routes = mb["input_ids"], mb["routed_experts"]
                mbs.append(
                    {
                        "ids": ids.values().clone(),
                        "offsets": ids.offsets().clone(),
                        "routes": routes.values().clone(),
                        "response_mask": mb["response_mask"].clone(),
                    }
                )
        per_rank.append(mbs)
    return per_rank, steps


# ----------------------------------------------------------------------------------------- per rank
def run_rank(rank: int, world: int, microbatches, step: VerlStepPlan) -> dict:  # type: ignore[no-untyped-def]
    import copy

    from verl.utils.megatron.router_replay_patch import (
        RouterReplay,
        RouterReplayAction,
        apply_router_replay_patch,
    )
    from verl.utils.megatron.router_replay_utils import (
        align_r3_router_replay_data,
        build_r3_replay_mask,
        set_router_replay_data,
    )

    from relibra.integrations.verl import ReplayFallbackError, VerlActorHook, verl_cpu_patches
    from relibra.megatron.model import TinyMoEModel, TinyMoESpec, init_expert_parallel

    init_expert_parallel(world)
    apply_router_replay_patch()  # verl's MegatronEngine does this before it builds the model
    spec = TinyMoESpec(NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, seed=3)
    plain = TinyMoEModel(spec, world)
    relib = TinyMoEModel(spec, world, replica_slots=R)
    for m in (plain, relib):
        for layer, module in enumerate(m.moe):
            module.set_layer_number(layer + 1)
    assert relib.adapter is not None
    tf_config = copy.deepcopy(relib.moe[0].config)
    tf_config.num_layers = NUM_LAYERS
    embed = embedding()
    opts = [torch.optim.Adam(m.trainable_parameters(), lr=1e-2) for m in (plain, relib)]
    hook = VerlActorHook(relib.adapter)
    loads: list[list[np.ndarray]] = []

    def capture(module, args, output) -> None:  # type: ignore[no-untyped-def]
        loads[-1].append(output[1].sum(dim=0).numpy().astype(np.int64))  # tokens per physical expert

    for module in relib.moe:
        module.router.register_forward_hook(capture)
    out: dict = {"plain": [], "relibra": [], "moved": None}
    with verl_cpu_patches():
        out["moved"] = hook.begin_update(step, opts[1])
        for opt in opts:
            opt.zero_grad()
        for mb in microbatches:
            ids = torch.nested.nested_tensor_from_jagged(mb["ids"], offsets=mb["offsets"])
            for name, model, replay_mask in (
                ("plain", plain, None),  # every row replayed, the filler last row too
                ("relibra", relib, build_r3_replay_mask(ids, mb["response_mask"])),  # verl's R3 mask; lifted
            ):
                if name == "relibra":
                    loads.append([])
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                routes = torch.nested.nested_tensor_from_jagged(mb["routes"], offsets=mb["offsets"])
                routes = align_r3_router_replay_data(routes, ids)
                set_router_replay_data(routes, None, tf_config, 0, replay_mask=replay_mask, model=model)
                x = embed[mb["ids"]].clone().requires_grad_(True)
                y = model(x)
                (y * torch.linspace(-1.0, 1.0, y.numel()).view_as(y)).sum().backward()
                out[name].append((y.detach().numpy().copy(), x.grad.numpy().copy()))
        hook.end_update()
        out["grads"] = {
            name: {
                "experts": [m.expert_grad_state(layer) for layer in range(NUM_LAYERS)],
                "routers": [r.weight.grad.numpy().copy() for r in m.routers],
                "mix": m.mix.grad.numpy().copy(),
            }
            for name, m in (("plain", plain), ("relibra", relib))
        }
        out["phy2log"] = relib.adapter.phy2log.copy()
        out["loads"] = loads
        out["microbatches_run"] = hook.microbatches_run

        # Replay that would silently fall back to native routing is refused.
        first = microbatches[0]
        x0 = embed[first["ids"]]
        refused = {}
        hook.begin_update(step, opts[1])
        RouterReplay.clear_global_indices()  # REPLAY_FORWARD, but no targets: verl would route natively
        try:
            relib(x0)
        except ReplayFallbackError as err:
            refused["no_targets"] = str(err)
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as McoreAction

        ids = torch.nested.nested_tensor_from_jagged(first["ids"], offsets=first["offsets"])
        routes = align_r3_router_replay_data(
            torch.nested.nested_tensor_from_jagged(first["routes"], offsets=first["offsets"]), ids
        )
        set_router_replay_data(routes, None, tf_config, 0, model=relib)
        for r in relib.routers:
            r.router_replay.set_router_replay_action(
                McoreAction.REPLAY_FORWARD
            )  # megatron's enum: ignored by verl
        try:
            relib(x0)
        except ReplayFallbackError as err:
            refused["wrong_enum"] = str(err)
        hook.end_update()
        # Without the hook's check, the adapter's router refuses native routes under a plan.
        RouterReplay.clear_global_indices()
        relib.adapter.set_microbatch(step.plan, 0)
        try:
            relib.moe[0].router(x0.unsqueeze(1))
        except ValueError as err:
            refused["native_under_plan"] = str(err)
        relib.adapter.clear_microbatch()
        out["refused"] = refused
    return out


@functools.cache
def world_run():  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    batch, recorded = rollout_batch(rng)
    cluster, model = planning_specs(
        load_hardware(REPO / "experiments/conf/cluster/hopper.yaml"), WORLD, NUM_LAYERS, NUM_EXPERTS, TOP_K
    )
    planner = relibra(R, reorder=AnnealConfig(locality=False), replicate=GreedyConfig(refill_aware=False))
    hook = VerlReLibraHook.from_verl_config(
        verl_config(), planner, cluster, model, config=ControlPlaneConfig(workers=0, warm_up=False)
    )
    try:
        key = hook.after_rollout(batch)
        # ... rewards, old and reference log-probabilities, advantages: the control plane plans meanwhile
        step = hook.before_update(batch, key)
    finally:
        hook.close()
    batch.meta_info[STEP_KEY] = step  # as ReLibraTrainerMixin._update_actor does
    microbatches, steps = verl_microbatches(batch)
    # NOTE: fork, not spawn: the children inherit this process's imports (verl alone takes about 25 s to
    # import on the shared 2-core machine); nothing here has touched CUDA.
    ranks = launch(_rank_entry, WORLD, microbatches, steps, start_method="fork")
    return batch, recorded, step, microbatches, ranks, steps


def _rank_entry(rank: int, world: int, microbatches, steps):  # type: ignore[no-untyped-def]
    return run_rank(rank, world, microbatches[rank], steps[rank])


@pytest.fixture(scope="module")
def run():  # type: ignore[no-untyped-def]
    return world_run()


# -------------------------------------------------------------------------------------------- checks
def test_plan_is_valid_and_nontrivial(run) -> None:  # type: ignore[no-untyped-def]
    _, _, step, microbatches, ranks, steps = run
    plan = step.plan
    for carried in steps:  # every rank's chunk carried the driver's plan
        assert np.array_equal(carried.order, step.order)
        np.testing.assert_array_equal(carried.plan.assign, plan.assign)
    assert step.num_microbatches == 2 and all(len(m) == 2 for m in microbatches)
    assert (plan.replicas >= 0).sum() > 0, "the plan must replicate (hot experts 0 and 1)"
    assert sum(r["moved"] for r in ranks) > 0, "the plan must move experts off the static placement"
    assert all(r["microbatches_run"] == 2 for r in ranks)
    assert (plan.assign.sum(axis=-1) == plan.load.sum(axis=2)).all()


def test_each_rank_trains_the_plans_samples(run) -> None:  # type: ignore[no-untyped-def]
    _, recorded, step, microbatches, _, _ = run
    # after the reorder, verl's chunk g / micro-batch m holds the samples the plan put on (g, m), in order
    for g, mbs in enumerate(microbatches):
        for m, mb in enumerate(mbs):
            rows = step.order[
                (g * step.num_microbatches + m) * MICRO : (g * step.num_microbatches + m + 1) * MICRO
            ]
            assert (step.plan.sample_gpu[rows] == g).all()
            want = np.concatenate(
                [
                    np.concatenate([recorded[s], np.arange(TOP_K)[None, None].repeat(NUM_LAYERS, 1)])
                    for s in rows
                ]
            )
            np.testing.assert_array_equal(mb["routes"].numpy(), want)


def test_expert_loads_equal_the_plan(run) -> None:  # type: ignore[no-untyped-def]
    """Tokens each rank computes per expert (home rows and replica slots, from the routing maps of all
    source ranks) equal the plan's ``assign`` exactly (the integer split rule's per-copy sums,
    ``relibra.executors.split``)."""
    _, _, step, _, ranks, _ = run
    plan, per_gpu = step.plan, NUM_EXPERTS // WORLD
    slots = per_gpu + R
    for m in range(step.num_microbatches):
        for layer in range(NUM_LAYERS):
            phys = sum(r["loads"][m][layer] for r in ranks)  # tokens each physical expert computes
            got = np.zeros((NUM_EXPERTS, WORLD), dtype=np.int64)
            for g in range(WORLD):
                for i in range(per_gpu):
                    got[ranks[g]["phy2log"][layer, g, i], g] += phys[g * slots + i]
                for s in range(R):
                    e = plan.replicas[m, layer, g, s]
                    if e >= 0:
                        got[e, g] += phys[g * slots + per_gpu + s]
                    else:
                        assert phys[g * slots + per_gpu + s] == 0
            np.testing.assert_array_equal(got, plan.assign[m, layer])


def test_balanced_equals_plain(run) -> None:  # type: ignore[no-untyped-def]
    ranks = run[4]
    for r in ranks:
        for (y0, gx0), (y1, gx1) in zip(r["plain"], r["relibra"], strict=True):
            np.testing.assert_allclose(y1, y0, atol=ATOL, rtol=RTOL)
            np.testing.assert_allclose(gx1, gx0, atol=ATOL, rtol=RTOL)
        for key in ("routers", "mix"):
            np.testing.assert_allclose(
                np.asarray(r["grads"]["relibra"][key]),
                np.asarray(r["grads"]["plain"][key]),
                atol=ATOL,
                rtol=RTOL,
            )
    for layer in range(NUM_LAYERS):
        merged = {
            name: {e: v for r in ranks for e, v in r["grads"][name]["experts"][layer].items()}
            for name in ("plain", "relibra")
        }
        assert sorted(merged["relibra"]) == list(range(NUM_EXPERTS))
        for e in range(NUM_EXPERTS):
            plain = np.asarray(merged["plain"][e])
            scale = GRAD_RTOL * float(np.abs(plain).max())
            np.testing.assert_allclose(merged["relibra"][e], plain, atol=max(ATOL, scale), rtol=GRAD_RTOL)


def test_native_routing_cannot_pass_unnoticed(run) -> None:  # type: ignore[no-untyped-def]
    for r in run[4]:
        refused = r["refused"]
        assert "without targets" in refused["no_targets"]
        assert "would compute native routes" in refused["wrong_enum"]
        assert "replay the routes the plan was made from" in refused["native_under_plan"]

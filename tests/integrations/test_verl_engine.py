"""verl 0.9.1's own ``MegatronEngine``, extended by
:func:`~relibra.integrations.verl_trainer.relibra_megatron_engine`, built as verl's worker builds it.

One forked gloo group of 2 ranks constructs the engine from verl's own config classes (``HFModelConfig``
over a Hugging Face Qwen3-MoE checkpoint written here by ``transformers``, ``McoreEngineConfig`` with EP 2,
``vanilla_mbridge=true``, ``router_replay.mode=R3``). verl's ``__init__`` sets up Megatron's parallel state
and applies its router-replay patch. Then:

* the **forward-only engine** (the reference / old-policy model) runs verl's whole ``initialize()``: the
  config, ``make_megatron_module`` -> mbridge's ``get_model`` (the provider, the move to the device, the
  bf16 wrapper) and the checkpoint load by ``bridge.load_weights``, then verl's offload step;
* the **training engine** runs the model half of ``initialize()`` (``_build_tf_config`` and
  ``_build_megatron_module``: the same, wrapped in Megatron-core's ``DistributedDataParallel``).
  Megatron-core's optimizer, the other half, allocates its scale on ``'cuda'`` in its constructor, so it
  is not built here.

Checked on both: every MoE layer has the replicating router and ``E / G + r`` rows, the engine carries the
adapter, and the model exported through the engine's bridge is the checkpoint bit for bit (cast to bf16),
at the static placement and again after the adapter moved experts (so the rows hold the logical experts the
placement says). On the forward-only engine the logits equal the checkpoint's in bf16, before and after the
move; on the training engine every physical row is in DDP's gradient buffers and a backward fills them.

CPU stand-ins, none on ReLibra's side: those of :mod:`tests.integrations.mbridge_builders`, the fusions
off and CPU initialisation through verl's own ``override_transformer_config``, ``nn.Module.cuda`` a no-op
(mbridge's ``get_model`` moves every chunk to the GPU), verl's ``log_gpu_memory_usage`` a no-op (it reads
``torch.cuda.mem_get_info``), and Megatron-core's optimizer on CPU (:func:`_megatron_optimizer_on_cpu`).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install '.[verl]' (docs/integrations.md)")
pytest.importorskip("mbridge", reason="mbridge is not installed: pip install '.[mbridge]'")

from relibra.executors.torch_executor import launch
from relibra.megatron.physical import PhysicalExpertMap
from tests.integrations.mbridge_builders import CPU_OFF, cpu_stand_ins, qwen3_moe_config, replica_plan

pytestmark = pytest.mark.verl

WORLD, R = 2, 1
NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, VOCAB, SEQ = 2, 16, 8, 8, 2, 64, 12
ENGINES = ("forward_only", "training")


def _moved_home() -> np.ndarray:
    """[L, E]: layer 0 swaps the two ranks' experts, layer 1 interleaves them."""
    static = np.arange(NUM_EXPERTS) // (NUM_EXPERTS // WORLD)
    return np.stack([(static + 1) % WORLD, np.arange(NUM_EXPERTS) % WORLD])


def _engine(ckpt_dir: str, forward_only: bool, distributed_optimizer: bool = True) -> Any:
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config.actor import RouterReplayConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from relibra.integrations.verl_trainer import relibra_megatron_engine

    cls = relibra_megatron_engine(MegatronEngine, lambda e: PhysicalExpertMap(NUM_EXPERTS, WORLD, R))
    engine_config = McoreEngineConfig(
        expert_model_parallel_size=WORLD, sequence_parallel=False, vanilla_mbridge=True,
        forward_only=forward_only, dtype="bfloat16", use_distributed_optimizer=distributed_optimizer,
        router_replay=RouterReplayConfig(mode="R3"),
        override_transformer_config={**{key: False for key in CPU_OFF}, "use_cpu_initialization": True},
    )  # fmt: skip
    model_config = HFModelConfig(path=ckpt_dir, load_tokenizer=False)
    optimizer_config = McoreOptimizerConfig(lr=1e-2, total_training_steps=10)
    return cls(model_config, engine_config, optimizer_config, CheckpointConfig())


def _unwrap(chunk: Any) -> Any:
    """The GPTModel inside verl's wrappers (DDP, Float16Module)."""
    while isinstance(chunk.__dict__.get("_modules", {}).get("module"), torch.nn.Module):
        chunk = chunk.module
    return chunk


def _exported(engine: Any) -> dict[str, torch.Tensor]:
    return {name: w.detach().cpu().clone() for name, w in engine.bridge.export_weights(engine.module)}


def _logits(chunk: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return chunk(ids, torch.arange(SEQ)[None], mask).float().detach().clone()


@contextlib.contextmanager
def _megatron_optimizer_on_cpu() -> Iterator[None]:
    """Megatron-core's optimizers allocate their scalars on ``'cuda'`` and check parameters by their CUDA
    type names; inside the block, such allocations go to the CPU and CPU tensors report the CUDA names.
    Used around the optimizer's construction and step only (the forward runs without it)."""

    def on_cpu(factory: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    cuda_names = {torch.bfloat16: "BFloat16Tensor", torch.float16: "HalfTensor", torch.float32: "FloatTensor"}
    tensor_type = torch.Tensor.type

    def type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in cuda_names:
            return f"torch.cuda.{cuda_names[self.dtype]}"
        return tensor_type(self, *args, **kwargs)

    factories = ("tensor", "zeros", "ones", "empty", "full")
    saved = {name: getattr(torch, name) for name in factories}
    saved_device = torch.cuda.current_device
    for name in factories:
        setattr(torch, name, on_cpu(saved[name]))
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.Tensor.type = type_name  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for name in factories:
            setattr(torch, name, saved[name])
        torch.cuda.current_device = saved_device  # type: ignore[assignment]
        torch.Tensor.type = tensor_type  # type: ignore[method-assign]


def _train_step(engine: Any, ids: torch.Tensor, replicas: bool = False) -> dict[str, int]:
    """One step of verl's optimizer: backward into DDP's buffers, DDP's gradient sync, Megatron's step.
    With ``replicas``, the micro-batch runs under a plan whose replica slots compute part of every copied
    expert's tokens (its routes recorded on the model first, then replayed)."""
    import torch.distributed as dist
    from verl.utils.megatron.router_replay_patch import RouterReplayAction

    chunk, adapter = engine.module[0], engine.relibra_adapter
    engine.optimizer.zero_grad()
    chunk.zero_grad_buffer()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    used = {"fills": 0, "copies_used": 0}
    if not replicas:
        chunk(ids, torch.arange(SEQ)[None], mask).float().square().mean().backward()
    else:
        # verl's own RouterReplay (its patch is in place): record the routes, then replay them.
        replays = [layer.mlp.router.router_replay for layer in _unwrap(chunk).decoder.layers]
        for replay in replays:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad():
            chunk(ids, torch.arange(SEQ)[None], mask)
        recorded = [replay.get_recorded_indices().clone() for replay in replays]  # L x [T, k]
        mine = np.stack([r.numpy() for r in recorded], axis=1)  # [T, L, k]
        every: list = [None] * WORLD
        dist.all_gather_object(every, mine)
        plan = replica_plan(every, adapter.home, R, seed=7)
        fills = adapter.buffer.fills
        adapter.set_microbatch(plan, 0)
        for replay, targets in zip(replays, recorded, strict=True):
            replay.clear_indices()
            replay.set_target_indices(targets)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        chunk(ids, torch.arange(SEQ)[None], mask).float().square().mean().backward()
        for replay in replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
        adapter.clear_microbatch()
        assert plan.replicas is not None
        used["fills"] = adapter.buffer.fills - fills
        used["copies_used"] = int(
            sum(
                plan.assign[0, layer, e, g]
                for layer in range(NUM_LAYERS)
                for g in range(WORLD)
                for e in plan.replicas[0, layer, g]
                if e >= 0
            )
        )
    chunk.finish_grad_sync()
    with _megatron_optimizer_on_cpu():
        ok, _, _ = engine.optimizer.step()
    assert ok
    return used


def _expert_states(engine: Any, rank: int) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """(layer, logical expert, fc1|fc2) -> the distributed optimizer's master weights and moments of this
    rank's home rows, read through Megatron's own accessor."""
    adapter, out = engine.relibra_adapter, {}
    for layer in range(NUM_LAYERS):
        for e, row in zip(adapter.phy2log[layer, rank], adapter.home_rows(layer)):
            for which, p in enumerate((row.linear_fc1.weight, row.linear_fc2.weight)):
                (owner,) = [
                    o for o in engine.optimizer.chained_optimizers if p in o.model_param_group_index_map
                ]
                states = owner._get_main_param_and_optimizer_states(p)
                out[layer, int(e), which] = {k: v.detach().clone() for k, v in states.items() if v.ndim}
    return out


def _refused(engine: Any, optimizer: Any) -> str:
    """What ``apply_placement`` under ``optimizer`` says, and whether any expert moved before it said it."""
    from relibra.megatron.optimizer_state import OptimizerStateError

    adapter = engine.relibra_adapter
    before = adapter.home.copy()
    try:
        adapter.apply_placement(_moved_home(), optimizer)
    except OptimizerStateError as exc:
        return f"{'moved' if (adapter.home != before).any() else 'unmoved'}: {exc}"
    return "accepted"


def _refusals(engine: Any) -> list[str]:
    """The distributed optimizer's configurations whose copies cannot move: precision-aware states, and
    expert rows sharded over an expert-data-parallel group (a stand-in group of 2 ranks)."""

    class _GroupOfTwo:
        def size(self) -> int:
            return 2

    out = []
    expert_optimizer = engine.optimizer.chained_optimizers[-1]
    config = expert_optimizer.config
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    out.append(_refused(engine, engine.optimizer))
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = False
    groups = [o.data_parallel_group for o in engine.optimizer.chained_optimizers]
    for o in engine.optimizer.chained_optimizers:
        o.data_parallel_group = _GroupOfTwo()
    out.append(_refused(engine, engine.optimizer))
    for o, group in zip(engine.optimizer.chained_optimizers, groups):
        o.data_parallel_group = group
    return out


def _hook_without_optimizer(engine: Any) -> str:
    """A ``VerlActorHook`` made without the training engine's optimizer, asked to move experts."""
    from relibra.integrations.verl import VerlActorHook, VerlStepPlan
    from relibra.types import BatchPlan

    home = _moved_home().astype(np.int32)
    assign = np.zeros((1, NUM_LAYERS, NUM_EXPERTS, WORLD), dtype=np.int32)
    load = np.zeros((1, NUM_LAYERS, WORLD, NUM_EXPERTS), dtype=np.int32)
    plan = BatchPlan(home=home, assign=assign, load=load, sample_gpu=np.arange(WORLD, dtype=np.int32))
    hook = VerlActorHook(engine.relibra_adapter)
    try:
        hook.begin_update(VerlStepPlan(plan, np.arange(WORLD), 1, 1))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def run_rank(rank: int, world: int, ckpt_dir: str) -> dict:  # type: ignore[no-untyped-def]
    import verl.workers.engine.megatron.transformer_impl as transformer_impl
    from megatron.core.distributed import DistributedDataParallel
    from transformers import Qwen3MoeForCausalLM

    from relibra.megatron.cpu_patches import apply_cpu_patches
    from relibra.megatron.router import ReplicatingRouter

    apply_cpu_patches()
    cpu_stand_ins()
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    transformer_impl.log_gpu_memory_usage = lambda *a, **k: None
    ids = [
        torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(5 + 10 * step + rank))
        for step in range(2)
    ]
    out: dict[str, Any] = {}
    for name in (*ENGINES, "unmoved", "moved_without_optimizer"):
        engine = _engine(ckpt_dir, forward_only=name == "forward_only")
        with _megatron_optimizer_on_cpu():
            engine.initialize()
        chunk = engine.module[0]
        layers = [layer.mlp for layer in _unwrap(chunk).decoder.layers]
        adapter = engine.relibra_adapter
        got: dict[str, Any] = {
            "routers": [type(m.router) is ReplicatingRouter for m in layers],
            "rows": [len(m.experts.local_experts) for m in layers],
            "experts": int(engine.tf_config.num_moe_experts),
            "ddp": isinstance(chunk, DistributedDataParallel),
            "adapter": adapter is not None,
            "export": {"static": _exported(engine)},
        }
        if name == "forward_only":
            chunk.eval()
            got["logits"] = {"static": _logits(chunk, ids[0])}
            adapter.apply_placement(_moved_home())
            got["export"]["moved"] = _exported(engine)
            got["logits"]["moved"] = _logits(chunk, ids[0])
        else:
            # Two steps of verl's optimizer; between them the experts move (but not on "unmoved"), so the
            # second step starts from moved rows with Adam's moments of the first.
            _train_step(engine, ids[0])
            if name != "unmoved":
                adapter.apply_placement(
                    _moved_home(), None if name == "moved_without_optimizer" else engine.optimizer
                )
            got["replicas"] = _train_step(engine, ids[1], replicas=name == "training")
            got["states"] = _expert_states(engine, rank)
            rows = [p for m in layers for p in m.experts.parameters()]
            got["rows_in_buffers"] = all(isinstance(p.__dict__.get("main_grad"), torch.Tensor) for p in rows)
            home = [
                p for layer in range(NUM_LAYERS) for row in adapter.home_rows(layer) for p in row.parameters()
            ]
            got["home_grads"] = [float(p.main_grad.abs().sum()) for p in home]
        if name == "unmoved":
            got["refused"] = _refusals(engine)
            got["hook_refused"] = _hook_without_optimizer(engine)
        got["home"] = adapter.home.copy()
        out[name] = got
    engine = _engine(ckpt_dir, forward_only=False, distributed_optimizer=False)
    with _megatron_optimizer_on_cpu():
        engine.initialize()
    out["non_distributed"] = {
        "refused": [_refused(engine, engine.optimizer)],
        "home": engine.relibra_adapter.home,
    }
    hf = Qwen3MoeForCausalLM.from_pretrained(ckpt_dir, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out["theirs"] = hf(ids[0]).logits.float().detach().clone()
    return out


@functools.cache
def world_run() -> tuple[list[dict], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(
            qwen3_moe_config(NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, VOCAB)
        ).save_pretrained(tmp)
        checkpoint = load_file(f"{tmp}/model.safetensors")
        return launch(run_rank, WORLD, tmp, start_method="fork"), checkpoint


@pytest.fixture(scope="module")
def run() -> tuple[list[dict], dict[str, torch.Tensor]]:
    return world_run()


@pytest.mark.parametrize("engine", ENGINES)
def test_verls_engine_builds_the_physical_model(run, engine: str) -> None:  # type: ignore[no-untyped-def]
    ranks, _ = run
    for got in ranks:
        g = got[engine]
        assert g["routers"] == [True] * NUM_LAYERS
        assert g["rows"] == [NUM_EXPERTS // WORLD + R] * NUM_LAYERS
        assert g["experts"] == NUM_EXPERTS + WORLD * R  # the engine's tf_config counts the physical rows
        assert g["adapter"]
        assert g["ddp"] == (engine == "training")
        np.testing.assert_array_equal(g["home"], _moved_home())


@pytest.mark.parametrize(
    ("engine", "stage"), [("forward_only", "static"), ("forward_only", "moved"), ("training", "static")]
)
def test_the_engines_model_exports_the_checkpoint(run, engine: str, stage: str) -> None:  # type: ignore[no-untyped-def]
    """The checkpoint verl loaded, exported back through the engine's bridge (replica slots dropped, rows
    renamed through the current placement), equals the checkpoint bit for bit in the engine's bf16: as
    loaded, and after the adapter moved bf16 rows between the ranks."""
    ranks, checkpoint = run
    for got in ranks:
        exported = got[engine]["export"][stage]
        assert sorted(exported) == sorted(checkpoint)
        for name, theirs in checkpoint.items():
            torch.testing.assert_close(exported[name], theirs.to(torch.bfloat16), rtol=0, atol=0, msg=name)


def _states(ranks: list[dict], engine: str) -> dict:
    return {key: value for got in ranks for key, value in got[engine]["states"].items()}


def test_moved_experts_train_on_as_if_unmoved(run) -> None:  # type: ignore[no-untyped-def]
    """Two optimizer steps with the experts moved between them, the second under a plan with replicas,
    against the same two steps unmoved and without replicas: every logical expert's fp32 master weights and
    Adam moments agree (the moved rows took the distributed optimizer's copies with them, and the copies'
    gradients reached their home rows in DDP's buffers). The copies' gradients are bf16 partial sums
    (the rows' dtype), so they differ from the unsplit bf16 gradient by bf16 rounding (measured: up to
    0.4 % of a tensor's largest entry): compared at 2 % of it. Checked: with the copies' gradients
    read from and added to ``p.grad`` only (the adapter before it knew DDP's ``main_grad``), the copied
    experts' states differ by 20-100 % of their largest entry."""
    ranks, _ = run
    for got in ranks:
        assert got["training"]["replicas"]["fills"] > 0  # the slots were filled ...
        assert got["training"]["replicas"]["copies_used"] > 0  # ... and computed tokens
    moved, unmoved = _states(ranks, "training"), _states(ranks, "unmoved")
    assert (
        sorted(moved)
        == sorted(unmoved)
        == sorted(
            (layer, e, which) for layer in range(NUM_LAYERS) for e in range(NUM_EXPERTS) for which in range(2)
        )
    )
    for key, theirs in unmoved.items():
        assert sorted(moved[key]) == sorted(theirs) == ["exp_avg", "exp_avg_sq", "param"]
        for name, value in theirs.items():
            tol = 2e-2 * float(value.abs().max())
            torch.testing.assert_close(moved[key][name], value, rtol=2e-2, atol=tol, msg=f"{key} {name}")
    assert any(float(v["exp_avg"].abs().max()) > 0 for v in unmoved.values())  # the moments are real


def test_moving_without_the_optimizer_is_caught(run) -> None:  # type: ignore[no-untyped-def]
    """The check above can fail: rows moved without the optimizer's copies train on the old expert's
    master weights, so the moved experts' master weights differ from the unmoved run's."""
    ranks, _ = run
    wrong, unmoved = _states(ranks, "moved_without_optimizer"), _states(ranks, "unmoved")
    static = np.arange(NUM_EXPERTS) // (NUM_EXPERTS // WORLD)
    moved = [
        (layer, e)
        for layer in range(NUM_LAYERS)
        for e in range(NUM_EXPERTS)
        if _moved_home()[layer, e] != static[e]
    ]
    assert moved
    for layer, e in moved:
        ours, theirs = wrong[layer, e, 0]["param"], unmoved[layer, e, 0]["param"]
        assert float((ours - theirs).abs().max()) > 0.1 * float(theirs.abs().max())


@pytest.mark.parametrize("stage", ["static", "moved"])
def test_forward_only_engine_computes_the_checkpoints_logits(run, stage: str) -> None:  # type: ignore[no-untyped-def]
    """bf16 on both sides, summed in other orders: compared at bf16's resolution of the logits' scale."""
    ranks, _ = run
    for got in ranks:
        ours, theirs = got["forward_only"]["logits"][stage], got["theirs"]
        assert ours.shape == theirs.shape == (1, SEQ, VOCAB)
        assert theirs.abs().max() > 1e-2  # logits of a real forward, not zeros
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2 * float(theirs.abs().max()))


def test_optimizers_whose_copies_cannot_move_are_refused_before_any_move(run) -> None:  # type: ignore[no-untyped-def]
    ranks, _ = run
    static = np.broadcast_to(np.arange(NUM_EXPERTS) // (NUM_EXPERTS // WORLD), (NUM_LAYERS, NUM_EXPERTS))
    for got in ranks:
        aware, sharded = got["unmoved"]["refused"]
        assert aware.startswith("unmoved: optimizer config use_precision_aware_optimizer=true")
        assert sharded.startswith("unmoved: the distributed optimizer shards the expert parameters over an ")
        assert "group of 2 ranks" in sharded
        (plain,) = got["non_distributed"]["refused"]
        assert plain.startswith("unmoved: optimizer ChainedOptimizer holds Float16OptimizerWithFloat16Params")
        assert "use_distributed_optimizer=true" in plain
        np.testing.assert_array_equal(got["non_distributed"]["home"], static)
        np.testing.assert_array_equal(got["unmoved"]["home"], static)
        assert got["unmoved"]["hook_refused"].startswith(
            "VerlActorHook: the actor's expert rows are in Megatron"
        )
        assert "VerlActorHook(adapter, engine.optimizer)" in got["unmoved"]["hook_refused"]


def test_training_engines_rows_are_in_ddps_buffers_and_get_gradients(run) -> None:  # type: ignore[no-untyped-def]
    ranks, _ = run
    for got in ranks:
        g = got["training"]
        assert g["rows_in_buffers"]
        assert len(g["home_grads"]) > 0 and any(v > 0 for v in g["home_grads"])

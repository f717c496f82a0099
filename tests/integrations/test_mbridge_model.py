"""The physical model built by mbridge itself (:func:`relibra.integrations.mbridge.physical_bridge`).

verl's Megatron workers build the actor with ``bridge.get_model(...)``, which calls the bridge's model
provider and then moves the model to the GPU and wraps it in DDP. Here one forked gloo group of 2 ranks
(EP 2) calls the provider of ``physical_bridge(Qwen3MoEBridge(...))`` (mbridge's own ``_model_provider``,
the part of ``get_model`` that defines the model; the rest needs CUDA), attaches the adapter
(:func:`~relibra.integrations.mbridge.physical_adapter`), moves experts to a placement other than the static
one, loads a Hugging Face Qwen3-MoE checkpoint (written here by ``transformers`` from a random
initialisation) through mbridge's ``load_weights``, and runs a forward. The model is built as verl's
Megatron engine builds it, through :func:`~relibra.integrations.verl_trainer.relibra_megatron_engine` over a
stand-in for verl's ``MegatronEngine`` (verl is not in this venv; its two methods are mirrored). Checked:
every MoE layer has the replicating router and ``E / G + r`` rows, and the logits equal the Hugging Face
model's on the same tokens, at the static placement, after the adapter moved experts, after a load into
the moved placement and under a plan with replicas (routes recorded, then replayed), whose backward gives
the checkpoint model's expert and router gradients.

CPU stand-ins, none on ReLibra's side (:mod:`tests.integrations.mbridge_builders`): Megatron's local layer
spec instead of Transformer Engine's, the CUDA-only fusions off, CPU initialisation, the RNG tracker's fork
a no-op (dropout is off in ``eval()``), and an explicit causal mask.
"""

from __future__ import annotations

import functools
import tempfile

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install '.[megatron]'")
pytest.importorskip(
    "mbridge", reason="mbridge is not installed: pip install '.[mbridge]' (docs/integrations.md)"
)

from relibra.executors.torch_executor import launch
from relibra.integrations.expert_names import ExpertSyncError
from relibra.megatron.physical import PhysicalExpertMap
from tests.integrations.mbridge_builders import CPU_OFF, cpu_stand_ins, qwen3_moe_config, replica_plan

pytestmark = pytest.mark.megatron

WORLD, R = 2, 1
NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, VOCAB, SEQ = 2, 16, 8, 8, 2, 64, 12


def _hf_config():  # type: ignore[no-untyped-def]
    return qwen3_moe_config(NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, VOCAB)


def _moved_home() -> np.ndarray:
    """[L, E]: layer 0 swaps the two ranks' experts, layer 1 interleaves them."""
    static = np.arange(NUM_EXPERTS) // (NUM_EXPERTS // WORLD)
    return np.stack([(static + 1) % WORLD, np.arange(NUM_EXPERTS) % WORLD])


class _VerlMegatronEngine:
    """Stand-in for verl 0.9.1's ``MegatronEngine`` (``verl/workers/engine/megatron/transformer_impl.py``),
    the two methods :func:`~relibra.integrations.verl_trainer.relibra_megatron_engine` extends, as verl runs
    them on its mbridge path: ``_build_tf_config`` sets ``vanilla_bridge``, ``bridge`` (mbridge's
    ``AutoBridge.from_config``) and ``tf_config``; ``_build_megatron_module`` builds the model through
    ``self.bridge`` (``make_megatron_module`` -> ``bridge.get_model``; here its model provider, the CPU part)
    and loads the checkpoint with ``self.bridge.load_weights``."""

    def __init__(self, ckpt_dir: str, vanilla: bool = True) -> None:
        self.ckpt_dir, self.vanilla = ckpt_dir, vanilla

    def _build_tf_config(self) -> None:
        from mbridge.models.qwen3moe import Qwen3MoEBridge

        self.vanilla_bridge = self.vanilla
        self.bridge = Qwen3MoEBridge(_hf_config(), dtype=torch.float32)
        self.bridge.config.moe_enable_routing_replay = True  # verl sets it for router_replay.mode=R3
        self.tf_config = self.bridge.config

    def _build_megatron_module(self) -> list:
        for key in CPU_OFF:
            setattr(self.bridge.config, key, False)
        self.bridge.config.use_cpu_initialization = True
        module = [self.bridge._model_provider([])(pre_process=True, post_process=True)]
        self.bridge.load_weights(module, self.ckpt_dir)
        return module


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(ids, torch.arange(SEQ)[None], mask).detach().clone()


def run_rank(rank: int, world: int, ckpt_dir: str) -> dict:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    from relibra.integrations.mbridge import physical_adapter
    from relibra.integrations.verl_trainer import relibra_megatron_engine
    from relibra.megatron.model import init_expert_parallel
    from relibra.megatron.replay import recorded_routes, recording, replaying
    from relibra.megatron.router import ReplicatingRouter

    init_expert_parallel(world)
    cpu_stand_ins()
    engine_cls = relibra_megatron_engine(
        _VerlMegatronEngine, lambda engine: PhysicalExpertMap(NUM_EXPERTS, world, R)
    )
    engine = engine_cls(ckpt_dir)
    engine._build_tf_config()
    module = engine._build_megatron_module()  # built and loaded at the static placement
    model, adapter = module[0], engine.relibra_adapter
    model.eval()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(5 + rank))
    static = _logits(model, ids)
    adapter.apply_placement(_moved_home())  # the adapter moves the rows' weights
    moved = _logits(model, ids)
    engine.bridge.load_weights(module, ckpt_dir)  # a load after the move (a resume) reads the moved rows
    reloaded = _logits(model, ids)
    # A micro-batch with replicas: routes recorded on this model (home rows only), planned, replayed.
    routers = [layer.mlp.router for layer in model.decoder.layers]
    with recording(routers):
        _logits(model, ids)
    mine = recorded_routes(routers)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    plan = replica_plan(every, adapter.home, R, seed=7)
    fills = adapter.buffer.fills
    adapter.set_microbatch(plan, 0)
    with replaying(mine, routers, NUM_EXPERTS):
        replicated = _logits(model, ids)
    adapter.clear_microbatch()
    # Its backward: the home rows' gradients (the copies' reduced into them) against the checkpoint model's,
    # summed over the ranks (each rank's tokens reach every rank's experts), the router's per rank.
    weight = torch.linspace(-1.0, 1.0, SEQ * VOCAB).view(1, SEQ, VOCAB)
    model.zero_grad(set_to_none=True)
    adapter.set_microbatch(plan, 0)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with replaying(mine, routers, NUM_EXPERTS):
        (model(ids, torch.arange(SEQ)[None], mask) * weight).sum().backward()
    adapter.clear_microbatch()
    hf_grad = Qwen3MoeForCausalLM.from_pretrained(ckpt_dir, torch_dtype=torch.float32).eval()
    (hf_grad(ids).logits * weight).sum().backward()
    grads: dict = {"ours": [], "theirs": [], "router_ours": [], "router_theirs": []}
    for layer in range(NUM_LAYERS):
        experts = hf_grad.model.layers[layer].mlp.experts
        flat = torch.cat([experts.gate_up_proj.grad.reshape(NUM_EXPERTS, -1),
                          experts.down_proj.grad.reshape(NUM_EXPERTS, -1)], dim=1)  # fmt: skip
        dist.all_reduce(flat)
        home_grads = adapter.expert_grads(layer)
        grads["ours"].append({e: g.detach().clone() for e, g in home_grads.items()})
        grads["theirs"].append({e: flat[e].clone() for e in home_grads})
        grads["router_ours"].append(routers[layer].logical.weight.grad.detach().clone())
        grads["router_theirs"].append(hf_grad.model.layers[layer].mlp.gate.weight.grad.detach().clone())
    copies_used = int(sum(plan.assign[0, layer, e, g] for layer in range(NUM_LAYERS)
                          for g in range(world) for e in plan.replicas[0, layer, g] if e >= 0))  # fmt: skip
    with torch.no_grad():
        hf = Qwen3MoeForCausalLM.from_pretrained(ckpt_dir, torch_dtype=torch.float32).eval()
        theirs = hf(ids).logits.detach().clone()
    layers = [layer.mlp for layer in model.decoder.layers]
    dense = torch.nn.Module()
    dense.decoder = torch.nn.Module()
    dense.decoder.layers = torch.nn.ModuleList()
    try:
        physical_adapter([dense], adapter.expert_map)
        empty = "accepted"
    except ExpertSyncError as exc:
        empty = f"{type(exc).__name__}: {exc}"
    return {
        "routers": [type(m.router) is ReplicatingRouter for m in layers],
        "rows": [len(m.experts.local_experts) for m in layers],
        "experts": (engine.tf_config.num_moe_experts, engine.bridge.config.num_moe_experts),
        "home": adapter.home.copy(),
        "logits": {"static": static, "moved": moved, "reloaded": reloaded, "replicated": replicated},
        "buffer_fills": adapter.buffer.fills - fills,
        "grads": grads,
        "copies_used": copies_used,
        "theirs": theirs,
        "empty": empty,
    }


@functools.cache
def world_run() -> list[dict]:
    from transformers import Qwen3MoeForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(_hf_config()).save_pretrained(tmp)
        return launch(run_rank, WORLD, tmp, start_method="fork")


@pytest.fixture(scope="module")
def run() -> list[dict]:
    return world_run()


def test_mbridge_builds_the_physical_layers(run) -> None:  # type: ignore[no-untyped-def]
    for got in run:
        assert got["routers"] == [True] * NUM_LAYERS
        assert got["rows"] == [NUM_EXPERTS // WORLD + R] * NUM_LAYERS
        assert got["experts"] == (NUM_EXPERTS + WORLD * R,) * 2  # the engine's tf_config is the bridge's
        np.testing.assert_array_equal(got["home"], _moved_home())


@pytest.mark.parametrize("stage", ["static", "moved", "reloaded", "replicated"])
def test_physical_model_computes_the_checkpoints_logits(run, stage: str) -> None:  # type: ignore[no-untyped-def]
    """Loaded at the static placement, after the adapter moved experts, loaded again after the move, and a
    micro-batch under a plan whose replicas compute part of the tokens (recorded routes replayed)."""
    for got in run:
        ours = got["logits"][stage]
        assert ours.shape == (1, SEQ, VOCAB)
        torch.testing.assert_close(ours, got["theirs"], rtol=1e-5, atol=1e-6)
        assert ours.abs().max() > 1e-2  # logits of a real forward, not zeros


class _MegatronBridgeEngine:
    """verl's engine on its Megatron-Bridge path (``vanilla_mbridge=false``): another bridge class."""

    def _build_tf_config(self) -> None:
        self.vanilla_bridge, self.bridge, self.tf_config = False, object(), None

    def _build_megatron_module(self) -> list:
        raise AssertionError("not reached: the config step refuses")


def test_engine_refuses_verls_megatron_bridge_path() -> None:
    from relibra.integrations.verl import VerlConfigError
    from relibra.integrations.verl_trainer import relibra_megatron_engine

    engine = relibra_megatron_engine(
        _MegatronBridgeEngine, lambda e: PhysicalExpertMap(NUM_EXPERTS, WORLD, R)
    )
    with pytest.raises(VerlConfigError, match=r"actor\.megatron\.vanilla_mbridge=false"):
        engine()._build_tf_config()


def test_the_replicated_micro_batch_ran_on_its_copies(run) -> None:  # type: ignore[no-untyped-def]
    """The plan's replica slots were filled and received tokens, so the equal logits above are the copies'."""
    for got in run:
        assert got["buffer_fills"] > 0
        assert got["copies_used"] > 0


def test_adapter_refuses_chunks_without_moe_layers(run) -> None:  # type: ignore[no-untyped-def]
    assert all(got["empty"].startswith("ExpertSyncError: the model chunks hold no MoE layer") for got in run)


def test_replicating_spec_refuses_a_spec_without_moe_layers_or_with_grouped_experts() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from relibra.integrations.mbridge import replicating_layer_spec
    from relibra.megatron.router import replicating_router

    expert_map = PhysicalExpertMap(NUM_EXPERTS, WORLD, R)
    with pytest.raises(ExpertSyncError, match="no MoE layer"):
        replicating_layer_spec(get_gpt_layer_local_spec(), expert_map)
    moe = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    out = replicating_layer_spec(moe, expert_map)
    assert out.submodules.mlp.submodules.experts.module is SequentialMLP
    assert out.submodules.mlp.submodules.router.__qualname__ == replicating_router(expert_map).__qualname__
    assert moe.submodules.mlp.submodules.router is not out.submodules.mlp.submodules.router  # a copy
    grouped = replicating_layer_spec(moe, expert_map)
    grouped.submodules.mlp.submodules.experts = ModuleSpec(module=TEGroupedMLP)
    with pytest.raises(ExpertSyncError, match="not SequentialMLP"):
        replicating_layer_spec(grouped, expert_map)


def test_replicated_backward_gives_the_checkpoints_gradients(run) -> None:  # type: ignore[no-untyped-def]
    """Expert weight gradients of every home row (its copies' reduced into it) equal the checkpoint model's,
    summed over the ranks; each rank's router gradient equals the checkpoint's gate gradient for its
    tokens. Float32 sums in other orders: compared at 1e-4 of each gradient's largest entry."""
    for got in run:
        g = got["grads"]
        for layer in range(NUM_LAYERS):
            assert sorted(g["ours"][layer]) == sorted(g["theirs"][layer])
            for e, ours in g["ours"][layer].items():
                theirs = g["theirs"][layer][e]
                assert theirs.abs().max() > 0  # the expert received tokens' gradients
                tol = 1e-4 * float(theirs.abs().max())
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=tol)
            router = g["router_theirs"][layer]
            torch.testing.assert_close(
                g["router_ours"][layer], router, rtol=1e-4, atol=1e-4 * float(router.abs().max())
            )

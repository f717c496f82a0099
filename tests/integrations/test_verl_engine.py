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

CPU stand-ins, none on ReLibra's side: those of :mod:`tests.integrations.mbridge_builders`, the fusions off
and CPU initialisation through verl's own ``override_transformer_config``, ``nn.Module.cuda`` a no-op (mbridge's
``get_model`` moves every chunk to the GPU), and verl's ``log_gpu_memory_usage`` a no-op (it reads
``torch.cuda.mem_get_info``).
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install '.[verl]' (docs/integrations.md)")
pytest.importorskip("mbridge", reason="mbridge is not installed: pip install '.[mbridge]'")

from relibra.executors.torch_executor import launch
from relibra.megatron.physical import PhysicalLayout
from tests.integrations.mbridge_builders import CPU_OFF, cpu_stand_ins, qwen3_moe_config

pytestmark = pytest.mark.verl

WORLD, R = 2, 1
NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, VOCAB, SEQ = 2, 16, 8, 8, 2, 64, 12
ENGINES = ("forward_only", "training")


def _moved_home() -> np.ndarray:
    """[L, E]: layer 0 swaps the two ranks' experts, layer 1 interleaves them."""
    static = np.arange(NUM_EXPERTS) // (NUM_EXPERTS // WORLD)
    return np.stack([(static + 1) % WORLD, np.arange(NUM_EXPERTS) % WORLD])


def _engine(ckpt_dir: str, forward_only: bool) -> Any:
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config.actor import RouterReplayConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from relibra.integrations.verl_trainer import relibra_megatron_engine

    cls = relibra_megatron_engine(MegatronEngine, lambda e: PhysicalLayout(NUM_EXPERTS, WORLD, R))
    engine_config = McoreEngineConfig(
        expert_model_parallel_size=WORLD, sequence_parallel=False, vanilla_mbridge=True,
        forward_only=forward_only, dtype="bfloat16", router_replay=RouterReplayConfig(mode="R3"),
        override_transformer_config={**{key: False for key in CPU_OFF}, "use_cpu_initialization": True},
    )  # fmt: skip
    model_config = HFModelConfig(path=ckpt_dir, load_tokenizer=False)
    return cls(model_config, engine_config, McoreOptimizerConfig(lr=1e-3), CheckpointConfig())


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
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(5 + rank))
    out: dict[str, Any] = {}
    for name in ENGINES:
        engine = _engine(ckpt_dir, forward_only=name == "forward_only")
        if name == "forward_only":
            engine.initialize()
        else:
            engine._build_tf_config()
            engine.module = engine._build_megatron_module()
        chunk = engine.module[0]
        model = _unwrap(chunk)
        layers = [layer.mlp for layer in model.decoder.layers]
        got: dict[str, Any] = {
            "routers": [type(m.router) is ReplicatingRouter for m in layers],
            "rows": [len(m.experts.local_experts) for m in layers],
            "experts": int(engine.tf_config.num_moe_experts),
            "ddp": isinstance(chunk, DistributedDataParallel),
            "adapter": engine.relibra_adapter is not None,
            "export": {"static": _exported(engine)},
        }
        adapter = engine.relibra_adapter
        if name == "forward_only":
            chunk.eval()
            got["logits"] = {"static": _logits(chunk, ids)}
        adapter.apply_placement(_moved_home())
        got["home"] = adapter.home.copy()
        got["export"]["moved"] = _exported(engine)
        if name == "forward_only":
            got["logits"]["moved"] = _logits(chunk, ids)
        else:
            rows = [p for m in layers for p in m.experts.parameters()]
            got["rows_in_buffers"] = all(hasattr(p, "main_grad") for p in rows)
            chunk.zero_grad_buffer()
            mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
            chunk(ids, torch.arange(SEQ)[None], mask).float().square().mean().backward()
            home = [
                p for layer in range(NUM_LAYERS) for row in adapter.home_rows(layer) for p in row.parameters()
            ]
            got["home_grads"] = [float(p.main_grad.abs().sum()) for p in home]
        out[name] = got
    hf = Qwen3MoeForCausalLM.from_pretrained(ckpt_dir, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out["theirs"] = hf(ids).logits.float().detach().clone()
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


@pytest.mark.parametrize("stage", ["static", "moved"])
@pytest.mark.parametrize("engine", ENGINES)
def test_the_engines_model_exports_the_checkpoint(run, engine: str, stage: str) -> None:  # type: ignore[no-untyped-def]
    """The checkpoint verl loaded, exported back through the engine's bridge (replica slots dropped, rows
    renamed through the current placement), equals the checkpoint bit for bit in the engine's bf16."""
    ranks, checkpoint = run
    for got in ranks:
        exported = got[engine]["export"][stage]
        assert sorted(exported) == sorted(checkpoint)
        for name, theirs in checkpoint.items():
            torch.testing.assert_close(exported[name], theirs.to(torch.bfloat16), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", ["static", "moved"])
def test_forward_only_engine_computes_the_checkpoints_logits(run, stage: str) -> None:  # type: ignore[no-untyped-def]
    """bf16 on both sides, summed in other orders: compared at bf16's resolution of the logits' scale."""
    ranks, _ = run
    for got in ranks:
        ours, theirs = got["forward_only"]["logits"][stage], got["theirs"]
        assert ours.shape == theirs.shape == (1, SEQ, VOCAB)
        assert theirs.abs().max() > 1e-2  # logits of a real forward, not zeros
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2 * float(theirs.abs().max()))


def test_training_engines_rows_are_in_ddps_buffers_and_get_gradients(run) -> None:  # type: ignore[no-untyped-def]
    ranks, _ = run
    for got in ranks:
        g = got["training"]
        assert g["rows_in_buffers"]
        assert len(g["home_grads"]) > 0 and any(v > 0 for v in g["home_grads"])

"""mbridge's load and export on ReLibra's physical MoE model (:mod:`relibra.integrations.mbridge`).

One forked gloo group of 2 ranks (EP 2) builds the adapter's physical Megatron layers (``MoELayer`` with
``SequentialMLP`` rows and ReLibra's router wrapper, ``E + G * r`` rows) inside a decoder whose parameter
names are ``GPTModel``'s, moves experts to a placement other than the static one, and loads a Hugging Face
Qwen3-MoE checkpoint (written here, random weights) through mbridge's own ``Qwen3MoEBridge.load_weights``;
then exports through mbridge's own ``export_weights``. Checked: every home row holds its logical expert's
checkpoint weights, the router its gate, and the export is the checkpoint, name for name and bit for bit;
mbridge's unwrapped bridge cannot load this model (its local -> global map knows ``E / G`` rows per rank).
Attention, embeddings and norms pass through mbridge unchanged and are not in this model.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install '.[megatron]'")
pytest.importorskip(
    "mbridge", reason="mbridge is not installed: pip install '.[mbridge]' (docs/integrations.md)"
)

from relibra.executors.torch_executor import launch
from relibra.integrations.expert_names import ExpertSyncError
from relibra.integrations.mbridge import global_expert_names, physical_bridge
from relibra.megatron.physical import PhysicalExpertMap

pytestmark = pytest.mark.megatron

WORLD, R = 2, 1
NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K = 2, 16, 8, 8, 2


def _hf_config():  # type: ignore[no-untyped-def]
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=FFN,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip


def _checkpoint() -> dict[str, torch.Tensor]:
    """The logical model's routed experts and gates, Hugging Face names (Qwen3-MoE)."""
    gen = torch.Generator().manual_seed(11)
    out = {}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}.mlp"
        out[f"{prefix}.gate.weight"] = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)
        for e in range(NUM_EXPERTS):
            out[f"{prefix}.experts.{e}.gate_proj.weight"] = torch.randn(FFN, HIDDEN, generator=gen)
            out[f"{prefix}.experts.{e}.up_proj.weight"] = torch.randn(FFN, HIDDEN, generator=gen)
            out[f"{prefix}.experts.{e}.down_proj.weight"] = torch.randn(HIDDEN, FFN, generator=gen)
    return out


def _moved_home() -> np.ndarray:
    """[L, E]: a balanced placement other than the static one (layer 0 swaps the two ranks' experts, layer 1
    interleaves them)."""
    per = NUM_EXPERTS // WORLD
    static = np.arange(NUM_EXPERTS) // per
    return np.stack([(static + 1) % WORLD, np.arange(NUM_EXPERTS) % WORLD])


class _Layer(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module, layer_number: int) -> None:
        super().__init__()
        self.mlp, self.layer_number = mlp, layer_number


class _Decoder(torch.nn.Module):
    """``decoder.layers.{i}.mlp``: GPTModel's names for its MoE layers."""

    def __init__(self, moe: list[torch.nn.Module]) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(m, i + 1) for i, m in enumerate(moe)])


def run_rank(rank: int, world: int, ckpt_dir: str) -> dict:  # type: ignore[no-untyped-def]
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    from relibra.megatron.model import TinyMoEModel, TinyMoESpec, init_expert_parallel

    init_expert_parallel(world)
    spec = TinyMoESpec(NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, seed=3)
    relib = TinyMoEModel(spec, world, replica_slots=R)
    assert relib.adapter is not None
    adapter = relib.adapter
    adapter.apply_placement(_moved_home())
    model = _Decoder(list(relib.moe))
    bridge = Qwen3MoEBridge(_hf_config(), dtype=torch.float32)
    try:
        bridge.load_weights([model], ckpt_dir)
        plain_load = "loaded"
    except (KeyError, NotImplementedError) as exc:
        plain_load = f"{type(exc).__name__}: {exc}"
    phys = physical_bridge(bridge, adapter.expert_map, lambda: adapter.phy2log)
    phys.load_weights([model], ckpt_dir)
    rows = {
        layer: {
            i: {part: getattr(mlp, part).weight.detach().clone() for part in ("linear_fc1", "linear_fc2")}
            for i, mlp in enumerate(relib.moe[layer].experts.local_experts)
        }
        for layer in range(NUM_LAYERS)
    }
    routers = [r.weight.detach().clone() for r in relib.routers]  # the logical TopKRouters
    exported = [(name, t.detach().clone()) for name, t in phys.export_weights([model])]
    return {
        "plain_load": plain_load, "rows": rows, "routers": routers, "exported": exported,
        "phy2log": adapter.phy2log.copy(), "bridge_experts": (bridge.config.num_moe_experts,
                                                              phys.config.num_moe_experts),
    }  # fmt: skip


@functools.cache
def world_run() -> tuple[dict[str, torch.Tensor], list[dict]]:
    from safetensors.torch import save_file

    ckpt = _checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        save_file(ckpt, str(Path(tmp) / "model.safetensors"))
        _hf_config().save_pretrained(tmp)  # mbridge finds the checkpoint folder by its config.json
        ranks = launch(run_rank, WORLD, tmp, start_method="fork")
    return ckpt, ranks


@pytest.fixture(scope="module")
def run() -> tuple[dict[str, torch.Tensor], list[dict]]:
    return world_run()


def test_load_puts_each_logical_expert_in_its_home_row(run) -> None:  # type: ignore[no-untyped-def]
    ckpt, ranks = run
    expert_map = PhysicalExpertMap(NUM_EXPERTS, WORLD, R)
    phy2log = ranks[0]["phy2log"]
    assert not np.array_equal(phy2log, expert_map.static_phy2log(NUM_LAYERS)), "the placement must have moved"
    for rank, r in enumerate(ranks):
        np.testing.assert_array_equal(r["phy2log"], phy2log)
        for layer in range(NUM_LAYERS):
            for row in range(expert_map.experts_per_gpu):
                e = int(phy2log[layer, rank, row])
                hf = f"model.layers.{layer}.mlp.experts.{e}"
                want_fc1 = torch.cat([ckpt[f"{hf}.gate_proj.weight"], ckpt[f"{hf}.up_proj.weight"]])
                torch.testing.assert_close(r["rows"][layer][row]["linear_fc1"], want_fc1, rtol=0, atol=0)
                torch.testing.assert_close(
                    r["rows"][layer][row]["linear_fc2"], ckpt[f"{hf}.down_proj.weight"], rtol=0, atol=0
                )
            torch.testing.assert_close(r["routers"][layer], ckpt[f"model.layers.{layer}.mlp.gate.weight"])


def test_export_is_the_logical_checkpoint(run) -> None:  # type: ignore[no-untyped-def]
    ckpt, ranks = run
    for rank, r in enumerate(ranks):
        names = [n for n, _ in r["exported"]]
        assert len(names) == len(set(names)), f"rank {rank}: a name exported twice"
        exported = dict(r["exported"])
        assert sorted(exported) == sorted(ckpt), f"rank {rank}"
        for name, tensor in ckpt.items():
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


def test_unwrapped_bridge_cannot_load_the_physical_model(run) -> None:  # type: ignore[no-untyped-def]
    _, ranks = run
    for r in ranks:
        assert r["plain_load"] != "loaded"
        assert r["bridge_experts"] == (NUM_EXPERTS, NUM_EXPERTS + WORLD * R)


# ---------------------------------------------------------------------------------- name map alone
def test_global_names_of_rows_replicas_and_router() -> None:
    expert_map = PhysicalExpertMap(
        num_experts=4, num_gpus=2, replica_slots=1
    )  # rows per rank: 2 home + 1 slot
    phy2log = np.array([[[3, 0], [1, 2]]])  # [L=1, G, E / G]
    p = "decoder.layers.0.mlp"
    rows = [f"{p}.experts.local_experts.{i}.linear_fc{k}.weight" for i in range(3) for k in (1, 2)]
    names = {n: n for n in rows}
    names[f"{p}.router.logical.weight"] = f"{p}.router.logical.weight"
    load = global_expert_names(names, expert_map, phy2log, ep_rank=1, load=True)
    assert load[f"{p}.experts.local_experts.0.linear_fc1.weight"] == f"{p}.experts.linear_fc1.weight1"
    assert load[f"{p}.experts.local_experts.1.linear_fc2.weight"] == f"{p}.experts.linear_fc2.weight2"
    assert not any("local_experts.2." in k for k in load), "a replica slot is not read from the checkpoint"
    assert load[f"{p}.router.logical.weight"] == f"{p}.router.weight"
    export = global_expert_names(names, expert_map, phy2log, ep_rank=1, load=False)
    assert export[f"{p}.experts.local_experts.2.linear_fc1.weight"] == f"{p}.experts.linear_fc1.weight2"
    grouped = {f"{p}.experts.linear_fc1.weight1": f"{p}.experts.linear_fc1.weight1"}
    assert global_expert_names(grouped, expert_map, phy2log, 0, load=True) == {
        f"{p}.experts.linear_fc1.weight1": f"{p}.experts.linear_fc1.weight0"
    }
    with pytest.raises(ExpertSyncError, match="local expert row 3"):
        global_expert_names({f"{p}.experts.linear_fc1.weight3": f"{p}.experts.linear_fc1.weight3"},
                            expert_map, phy2log, 0, load=True)  # fmt: skip
    with pytest.raises(ExpertSyncError, match="ep_rank 2"):
        global_expert_names(names, expert_map, phy2log, 2, load=True)


def test_physical_bridge_refuses_a_bridge_of_another_shape() -> None:
    class _Cfg:
        num_moe_experts = 6

    class _Mpu:
        ep_size, etp_size = 2, 1

    class _Bridge:
        config, mpu = _Cfg(), _Mpu()

    expert_map = PhysicalExpertMap(num_experts=4, num_gpus=2, replica_slots=1)
    with pytest.raises(ExpertSyncError, match="num_moe_experts=6"):
        physical_bridge(_Bridge(), expert_map, expert_map.static_phy2log(1))
    _Cfg.num_moe_experts = 4
    _Mpu.etp_size = 2
    with pytest.raises(ExpertSyncError, match="etp_size=2"):
        physical_bridge(_Bridge(), expert_map, expert_map.static_phy2log(1))
    _Mpu.etp_size, _Mpu.ep_size = 1, 4
    with pytest.raises(ExpertSyncError, match="ep_size=4"):
        physical_bridge(_Bridge(), expert_map, expert_map.static_phy2log(1))

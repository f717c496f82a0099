"""Megatron-LM's token-imbalance workloads W0-W7 as a routing-trace source (docs/workloads.md).

Source: NVIDIA/Megatron-LM pull request #7488, ``benchmarks/moe/token_imbalance/benchmark.py``
(``routing_for_step``, ``_distinct_topk``, ``workload_fingerprint``) at commit ``f5c50249``, read and
re-written here. A step's routes are drawn from ``(workload, seed, step)`` alone, by the peer's own random
stream: a CPU ``torch.Generator`` seeded with the first 8 hex digits of ``sha256("W|seed|step")``, one
``torch.randperm`` of the candidate pool per token (its first ``k`` entries, sorted), then the gates from
``torch.rand``. So the routes and :func:`fingerprint` equal the peer's bit for bit under the same torch
(tests/trace/test_peer.py pins fingerprints computed with the peer's code).

The peer gives every EP rank the same ``T`` routes (its ``routing_for_step`` takes no rank), and routes one
MoE layer. In the trace :func:`peer_trace` writes, step ``s`` is batch ``s`` and rank ``r``'s ``T`` tokens are
sample ``r`` of that batch (so every sample of a batch holds the same routes, as in the peer); every MoE
layer is routed alike, or with ``layer_seeds=True`` layer ``l`` draws the peer's stream of seed
``seed + l * LAYER_SEED_STRIDE`` (layer 0 keeps the peer's own).

Usage::

    python -m relibra.trace.peer W2_hot_rank --model qwen3-30b-a3b --ep 32 --steps 12 --tokens 1024 \\
        --seed 0 --out w2.npz
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from relibra.trace.format import MAX_EXPERTS, RoutingTrace, save_trace

__all__ = [
    "LAYER_SEED_STRIDE",
    "PEER_COMMIT",
    "WORKLOADS",
    "ModelShape",
    "PeerArgs",
    "fingerprint",
    "main",
    "model_shape",
    "peer_trace",
    "pool_problem",
    "routes_for_step",
]

WORKLOADS = (
    "W0_balanced",
    "W1_hot_expert_set",
    "W2_hot_rank",
    "W3_spread_hot_experts",
    "W4_source_ragged",
    "W5_zero_expert_rank",
    "W6_rotating_hotspot",
    "W7_burst",
)
"""The peer's workload ids (``benchmark.py``: ``WORKLOADS``), in its order."""

PEER_COMMIT = "f5c50249d5fbad8c3905587f4101b6cf0cf2c2ae"
"""The commit of NVIDIA/Megatron-LM PR #7488's ``benchmark.py`` these definitions follow."""

LAYER_SEED_STRIDE = 1 << 20
"""With ``layer_seeds``, layer ``l`` draws the peer's stream of seed ``seed + l * LAYER_SEED_STRIDE``: a
choice of this suite (the peer routes one layer), so that each layer is a stream the peer's own CLI can
reproduce (``--seed``) and no two layers of seeds below 2**20 share one."""

MODEL_DIR = ("conf", "model")
"""Where the suite's model files are, under the ``experiments`` package (``--model`` names one)."""


def _generator(workload: str, seed: int, step: int) -> torch.Generator:
    """The peer's per-step stream: seeded by the first 32 bits of ``sha256("workload|seed|step")``."""
    digest = hashlib.sha256(f"{workload}|{seed}|{step}".encode()).hexdigest()
    return torch.Generator(device="cpu").manual_seed(int(digest[:8], 16))


def _pools(workload: str, num_experts: int, top_k: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(hot pool, the rest's pool) of ``workload`` at ``step``: the candidates a token draws from.

    W1, W2, W6: the hot pool for tokens ``t % 4 != 0``; W3 likewise with every other expert; W7 the hot
    pool for even tokens of every fourth step; W4 and W5 one pool for all tokens. Returned as int64 arrays.
    """
    everyone = np.arange(num_experts, dtype=np.int64)
    hotwidth = max(top_k, num_experts // 4)
    hot = np.arange(hotwidth, dtype=np.int64) % num_experts
    if workload == "W3_spread_hot_experts":
        # NOTE: the peer's code draws from every other expert (E/2 of them), not the README's "same heat as
        # W1" (E/4): its README's W3 imbalance row disagrees with its code; the code is followed.
        spread = np.unique((2 * np.arange(max(top_k, num_experts // 2))) % num_experts)
        return (spread if spread.size >= top_k else everyone), everyone
    if workload == "W5_zero_expert_rank":
        live = np.arange(num_experts // 2, num_experts, dtype=np.int64)
        live = live if live.size else everyone
        return live, live
    if workload == "W6_rotating_hotspot":
        base = ((step // 3) * hotwidth) % num_experts
        return (base + np.arange(hotwidth, dtype=np.int64)) % num_experts, everyone
    if workload == "W4_source_ragged":
        return everyone, everyone
    return hot, everyone


def _uses_hot(workload: str, tokens: int, step: int) -> np.ndarray:
    """bool [T]: which tokens draw from the hot pool (the peer's per-token rule)."""
    t = np.arange(tokens)
    if workload == "W7_burst":
        return (t % 2 == 0) & (step % 4 == 3)
    if workload == "W4_source_ragged":
        return np.zeros(tokens, dtype=bool)
    return t % 4 != 0


def pool_problem(workload: str, num_experts: int, top_k: int) -> str | None:
    """Why ``workload`` cannot draw ``top_k`` distinct experts of ``num_experts`` (None: it can)."""
    if workload not in WORKLOADS:
        return f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}"
    if top_k > num_experts:
        return f"top_k={top_k} exceeds num_experts={num_experts}"
    for step in range(12):  # NOTE: the pools repeat with the step's phase (W6: //3, W7: %4), 12 covers both
        hot, rest = _pools(workload, num_experts, top_k, step)
        if top_k > min(hot.size, rest.size):
            size = min(hot.size, rest.size)
            return f"{workload} draws from a pool of {size} experts, fewer than top_k={top_k}"
    return None


def routes_for_step(
    workload: str, num_experts: int, top_k: int, tokens: int, step: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """One step of a peer workload: (expert ids int64 [T, k], gates float32 [T, k]), as the peer draws them.

    Every row holds ``k`` distinct experts (sorted, except W0's round robin). Raises ValueError for an unknown
    workload or a pool smaller than ``k`` (:func:`pool_problem`).
    """
    if problem := pool_problem(workload, num_experts, top_k):
        raise ValueError(problem)
    g = _generator(workload, seed, step)
    if workload == "W0_balanced":
        row = np.arange(tokens, dtype=np.int64)[:, None]
        ids = (row * top_k + np.arange(top_k)) % num_experts
    else:
        hot, rest = _pools(workload, num_experts, top_k, step)
        ids = np.empty((tokens, top_k), dtype=np.int64)
        # NOTE: one randperm per token, in token order, is the peer's stream; it cannot be batched.
        for t, from_hot in enumerate(_uses_hot(workload, tokens, step)):
            pool = hot if from_hot else rest
            pick = torch.randperm(pool.size, generator=g)[:top_k].numpy()
            ids[t] = np.sort(pool[pick])
    gates = torch.rand((tokens, top_k), generator=g, dtype=torch.float32) * 0.5 + 0.5
    gates = gates / gates.sum(dim=1, keepdim=True)
    return ids, gates.numpy()


def fingerprint(
    workload: str, num_experts: int, top_k: int, tokens: int, steps: int, seed: int, ep: int
) -> str:
    """The peer's ``workload_checksum`` (16 hex digits): sha256 of the arguments, then of every step's ids
    and gates."""
    h = hashlib.sha256(f"{workload}|{num_experts}|{top_k}|{tokens}|{steps}|{seed}|{ep}".encode())
    for step in range(steps):
        ids, gates = routes_for_step(workload, num_experts, top_k, tokens, step, seed)
        h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(gates, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class ModelShape:
    """The routing shape of a model of ``experiments/conf/model``."""

    name: str
    num_experts: int
    top_k: int
    num_moe_layers: int


def model_shape(name: str) -> ModelShape:
    """The shape of the suite's model ``name`` (``experiments/conf/model/<name>.yaml``); ValueError if
    unknown."""
    spec = find_spec("experiments")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the experiments package (its conf/model files) is not importable")
    folder = Path(next(iter(spec.submodule_search_locations))).joinpath(*MODEL_DIR)
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise ValueError(f"unknown model {name!r}; choose one of {known}")
    node = OmegaConf.load(path)
    return ModelShape(
        name=str(node.name),
        num_experts=int(node.num_experts),
        top_k=int(node.top_k),
        num_moe_layers=int(node.num_moe_layers),
    )


@dataclass(frozen=True)
class PeerArgs:
    """What a peer trace is drawn from (the CLI's arguments)."""

    workload: str
    model: ModelShape
    ep: int
    """EP ranks: samples per batch."""
    steps: int
    """Steps: batches."""
    tokens: int
    """Tokens per rank per step (the peer's ``--tokens``)."""
    seed: int
    layer_seeds: bool = False
    """Draw layer ``l`` with seed ``seed + l * LAYER_SEED_STRIDE`` (False: every layer routed alike)."""

    def identity(self) -> dict[str, object]:
        """What a trace file's ``meta["peer"]`` records of these arguments (and what says a stored file is
        theirs): workload, seed, steps, tokens per rank, EP ranks and whether layers draw apart."""
        return {
            "workload": self.workload,
            "seed": self.seed,
            "steps": self.steps,
            "tokens_per_rank": self.tokens,
            "ep": self.ep,
            "layer_seeds": self.layer_seeds,
        }

    def problems(self) -> list[str]:
        """Every reason these arguments cannot make a trace, each naming its option."""
        out = []
        for key in ("ep", "steps", "tokens"):
            if getattr(self, key) < 1:
                out.append(f"--{key} {getattr(self, key)}: must be at least 1")
        if self.ep >= 1 and self.model.num_experts % self.ep:
            out.append(
                f"--ep {self.ep}: must divide the {self.model.num_experts} experts of "
                f"--model {self.model.name}"
            )
        if self.tokens >= 1 and self.tokens < self.model.top_k:
            out.append(
                f"--tokens {self.tokens}: below the peer's minimum of top_k={self.model.top_k} "
                "tokens per rank"
            )
        if problem := pool_problem(self.workload, self.model.num_experts, self.model.top_k):
            out.append(f"WORKLOAD {self.workload}: {problem}")
        if self.model.num_experts > MAX_EXPERTS:
            out.append(
                f"--model {self.model.name}: {self.model.num_experts} experts exceed the trace's int16 ids"
            )
        return out


def peer_trace(args: PeerArgs) -> RoutingTrace:
    """The trace of ``args``: batch ``s`` = step ``s``; sample ``r`` of it = rank ``r``'s ``T`` tokens, the
    peer's routes of that step (the same on every rank); experts int16 [steps * ep * T, L, k]."""
    if problems := args.problems():
        raise ValueError("; ".join(problems))
    shape, num_l = args.model, args.model.num_moe_layers
    steps = []
    for step in range(args.steps):
        if args.layer_seeds:
            layers = [
                routes_for_step(
                    args.workload,
                    shape.num_experts,
                    shape.top_k,
                    args.tokens,
                    step,
                    args.seed + l * LAYER_SEED_STRIDE,
                )[0]
                for l in range(num_l)
            ]
            per_rank = np.stack(layers, axis=1)  # [T, L, k]
        else:
            ids = routes_for_step(
                args.workload, shape.num_experts, shape.top_k, args.tokens, step, args.seed
            )[0]
            per_rank = np.broadcast_to(ids[:, None, :], (args.tokens, num_l, shape.top_k))
        steps.append(np.broadcast_to(per_rank.astype(np.int16), (args.ep, *per_rank.shape)))
    experts = np.ascontiguousarray(np.stack(steps)).reshape(-1, num_l, shape.top_k)
    num_samples = args.steps * args.ep
    meta = {
        "num_experts": shape.num_experts,
        "top_k": shape.top_k,
        "num_layers": num_l,
        "model": shape.name,
        "source": f"megatron-lm-pr7488@{PEER_COMMIT[:8]}",
        "dataset": args.workload,
        "peer": {
            **args.identity(),
            "layer_seed_stride": LAYER_SEED_STRIDE if args.layer_seeds else None,
            "checksum": fingerprint(
                args.workload, shape.num_experts, shape.top_k, args.tokens, args.steps, args.seed, args.ep
            ),
        },
    }
    return RoutingTrace(
        experts=experts,
        sample_offsets=np.arange(num_samples + 1, dtype=np.int64) * args.tokens,
        batch_offsets=np.arange(args.steps + 1, dtype=np.int64) * args.ep,
        meta=meta,
    )


def _out_problem(out: Path) -> str | None:
    if out.suffix != ".npz":
        return f"--out {out}: a trace file ends in .npz"
    if not out.parent.is_dir():
        return f"--out {out}: folder {out.parent} does not exist"
    if out.is_dir():
        return f"--out {out}: is a folder"
    return None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m relibra.trace.peer",
        description="Write a token-imbalance workload of Megatron-LM PR #7488 as a routing trace "
        "(docs/workloads.md).",
    )
    ap.add_argument("workload", metavar="WORKLOAD", help=f"one of {', '.join(WORKLOADS)}")
    ap.add_argument(
        "--model", required=True, help="a model of experiments/conf/model (its experts, top-k, layers)"
    )
    ap.add_argument("--ep", type=int, required=True, help="EP ranks: samples per batch")
    ap.add_argument("--steps", type=int, required=True, help="steps: batches")
    ap.add_argument("--tokens", type=int, required=True, help="tokens per rank per step")
    ap.add_argument("--seed", type=int, required=True, help="the peer's --seed")
    ap.add_argument("--layer-seeds", action="store_true", help="draw each MoE layer with its own seed")
    ap.add_argument("--out", type=Path, required=True, help="the trace file (.npz) to write")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one message naming the bad option before any work."""
    ns = _parser().parse_args(argv)
    try:
        shape = model_shape(ns.model)
    except ValueError as err:
        print(f"relibra.trace.peer: --model {ns.model}: {err}", file=sys.stderr)
        return 2
    args = PeerArgs(ns.workload, shape, ns.ep, ns.steps, ns.tokens, ns.seed, ns.layer_seeds)
    problems = args.problems()
    if out_problem := _out_problem(ns.out):
        problems.append(out_problem)
    if problems:
        print("relibra.trace.peer: " + "; ".join(problems), file=sys.stderr)
        return 2
    trace = peer_trace(args)
    save_trace(trace, ns.out)
    print(f"{ns.out}: {args.workload}, checksum {trace.meta['peer']['checksum']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

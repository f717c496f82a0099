"""The trace files of the ``peer`` presets, written before their grid runs (``experiments.reproduce``).

A peer cell reads ``trace.path``, which its preset builds from ``peer.dir`` and the cell's workload, model,
EP group, steps, tokens per rank, seed and ``peer.layer_seeds`` (``conf/experiment/peer.yaml``).
:func:`prepare_peer_traces` composes one cell per distinct trace of the preset's grid and writes each file
that is missing, or whose ``meta.peer`` names other arguments, with :func:`relibra.trace.peer.peer_trace`
(atomically); a file already right is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from experiments.config.presets import cells, compose_cells
from experiments.config.spec import RunSpec, build_spec
from relibra.trace.format import TraceFormatError, load_trace, save_trace
from relibra.trace.peer import ModelShape, PeerArgs, peer_trace

__all__ = ["PEER_DIR", "is_peer_preset", "peer_args", "prepare_peer_traces"]

PEER_DIR = ("traces", "peer")
"""Where under the results root the peer traces go (``RESULTS/traces/peer``)."""


def is_peer_preset(preset: str) -> bool:
    """Whether ``preset`` runs the peer's workloads (its cells need :func:`prepare_peer_traces`)."""
    return preset.removeprefix("quick_") == "peer"


def peer_args(spec: RunSpec) -> PeerArgs:
    """The trace arguments of a peer cell's run spec (``+experiment=peer``: the spec has a ``peer`` node)."""
    peer, model = spec.peer, spec.model
    if peer is None:
        raise ValueError("peer_args needs a peer cell (the peer node of conf/experiment/peer.yaml)")
    return PeerArgs(
        workload=peer.workload,
        model=ModelShape(
            name=model.name,
            num_experts=model.num_experts,
            top_k=model.top_k,
            num_moe_layers=model.num_moe_layers,
        ),
        ep=spec.cluster.nodes * spec.cluster.gpus_per_node,
        steps=peer.steps,
        tokens=peer.tokens,
        seed=spec.seed,
        layer_seeds=peer.layer_seeds,
    )


def _is_current(path: Path, args: PeerArgs) -> bool:
    """Whether the file at ``path`` is the trace of ``args`` (by its ``meta``; an unreadable file is not)."""
    if not path.is_file():
        return False
    try:
        meta = load_trace(path).meta
    except TraceFormatError:
        return False
    said = meta.get("peer") or {}
    return meta.get("model") == args.model.name and all(said.get(k) == v for k, v in args.identity().items())


def prepare_peer_traces(
    preset: str, root: Path, overrides: Sequence[str] = (), log: Callable[[str], None] = print
) -> str:
    """Write the trace files of ``preset``'s cells under ``root/traces/peer``; returns the ``peer.dir``
    override its cells need. ``overrides`` narrow or replace the sweep as for the grid itself."""
    folder = root.joinpath(*PEER_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    override = f"peer.dir={folder}"
    by_trace: dict[tuple[str, ...], list[str]] = {}
    for cell in cells(preset, [*overrides, override]):
        key = tuple(sorted(o for o in cell if not o.startswith("planner")))
        by_trace.setdefault(key, cell)
    for cfg in compose_cells(preset, [[*cell, override] for cell in by_trace.values()]):
        spec = build_spec(cfg)
        path, args = Path(str(spec.trace.path)), peer_args(spec)
        if _is_current(path, args):
            continue
        save_trace(peer_trace(args), path)
        log(f"peer trace written: {path}")
    return override


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.grid.peer_traces PRESET [--results DIR] [OVERRIDES...]``: write the preset's
    trace files (before a Slurm launch, which does not write them) and print the ``peer.dir`` override its
    cells need. Exit status 2 with one line for a preset that is not a peer preset."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m experiments.grid.peer_traces", description=main.__doc__)
    ap.add_argument("preset", help="peer or quick_peer")
    ap.add_argument(
        "overrides", nargs="*", help="Hydra overrides narrowing the sweep (e.g. model=deepseek-v3)"
    )
    ap.add_argument("--results", type=Path, default=Path("results"), help="results root (default results/)")
    ns = ap.parse_intermixed_args(argv)
    if not is_peer_preset(ns.preset):
        print(
            f"python -m experiments.grid.peer_traces: {ns.preset}: not a peer preset (peer, quick_peer)",
            file=sys.stderr,
        )
        return 2
    print(prepare_peer_traces(ns.preset, ns.results.resolve(), ns.overrides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The planner registry: one card per planner, the single place its name, label, colour, family, settings
and the information it plans from are declared.

Everything that lists planners reads :data:`CARDS`: the generated config nodes (``experiments/
planner_nodes.py``), the analysis' labels, colours and figure order (``analysis/paper.py``,
``analysis/figures.py``), the planner table of the README (``python -m analysis --write-docs``), the presets'
planner sweeps (``${planners:GRID}``: the cards whose ``grids`` name the preset, :func:`in_grid`), and the
tests that hold the planner yamls and the presets' sweeps to it (``tests/planners/test_registry.py``,
``tests/experiments/test_registry_configs.py``). Adding a planner is its module, one card here, its yaml and
its tests: docs/adding-a-planner.md.

A card names its settings by import path (the ``_target_`` its config node instantiates), so this module
imports no planner: the analysis reads labels and colours without loading a baseline, and the library does
not import the layer above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

__all__ = [
    "CARDS",
    "FAMILIES",
    "INFORMATION",
    "Family",
    "Information",
    "PlannerCard",
    "card",
    "colours",
    "figure_order",
    "in_grid",
    "label",
    "labels",
    "names",
]

Family = Literal["static", "online", "replay", "bound"]
FAMILIES: Final[dict[str, str]] = {
    "static": "the paper's baselines and their variants: a placement (with permanent copies or a prefetch) "
    "planned per batch or less often, from no loads, the batch's loads (the paper's '+': oracle loads) or "
    "history",
    "online": "plans every (micro-batch, layer) after the router runs, on the critical path",
    "replay": "plans every micro-batch before the step from the routing recorded at rollout (routing replay)",
    "bound": "a reference, not a method: an ideal bound or a ceiling of what a static placement reaches",
}
"""What each family means (docs/adding-a-planner.md)."""

Information = Literal["none", "oracle_batch", "oracle_microbatch", "routed_microbatch", "history", "previous"]
INFORMATION: Final[dict[str, str]] = {
    "none": "no loads (a fixed placement, or uniform routing)",
    "oracle_batch": "the exact loads of the batch, before it runs (routing replay)",
    "oracle_microbatch": "the exact loads of each micro-batch, before the step (routing replay)",
    "routed_microbatch": "each micro-batch's routing once the router has run (this layer's or the last)",
    "history": "earlier batches' loads, as many as the planner's history_batches declares",
    "previous": "the placement (or redundant copies) in force from the previous batch",
}
"""What a planner may read, in the words of :class:`~relibra.planners.protocols.BatchContext`."""


@dataclass(frozen=True)
class PlannerCard:
    """One planner as every consumer sees it."""

    name: str
    """The ``planner=NAME`` choice, the yaml ``experiments/conf/planner/<name>.yaml`` and the ``planner``
    result column; the planner's own ``name`` field equals it."""
    label: str
    """The display name in tables and figures (the paper's name where it has one)."""
    family: Family
    settings: str
    """Import path of what ``planner=NAME`` instantiates (its config node's ``_target_``): the settings
    dataclass whose fields are the ``planner.KEY=V`` knobs, or a composition's builder."""
    information: tuple[Information, ...]
    """What the planner plans from (:data:`INFORMATION`), with its default settings."""
    colour: tuple[str, int] | None = None
    """(seaborn palette, index) in every figure; None: a distinct ``husl`` hue, drawn after the coloured
    planners."""
    node: bool = False
    """Whether the node ``planner/base/<name>`` is generated from ``settings``' fields and defaults (a
    baseline's dataclass: its yaml is ``defaults: [base/<name>@_here_, _self_]``)."""
    variant_of: str | None = None
    """The card whose yaml this one's extends with the keys that differ (``defaults: [<base>, _self_]``)."""
    grids: tuple[str, ...] = ()
    """The preset grids that compare this planner (``experiments/conf/experiment/<grid>.yaml``, whose
    planner sweep is ``${planners:<grid>}``: :func:`in_grid`); a preset's quick version sweeps its own."""

    def __post_init__(self) -> None:
        if self.family not in get_args(Family):
            raise ValueError(
                f"planner card {self.name}: family={self.family!r}; expected one of {get_args(Family)}"
            )
        unknown = [i for i in self.information if i not in INFORMATION]
        if unknown or not self.information:
            raise ValueError(
                f"planner card {self.name}: information={self.information!r}; expected one or more of "
                f"{sorted(INFORMATION)}"
            )
        if any(not isinstance(g, str) or not g for g in self.grids) or len(set(self.grids)) < len(self.grids):
            raise ValueError(
                f"planner card {self.name}: grids={self.grids!r}; expected distinct preset names"
            )
        if self.node and self.variant_of is not None:
            raise ValueError(
                f"planner card {self.name}: a variant ({self.variant_of}) has no node of its own"
            )


_MEGATRON = "baselines.megatron.MegatronPlanner"
_EPLB = "baselines.eplb.EplbPlanner"
_RELIBRA = "relibra.planners.compose.relibra"
_REORDER_ONLY = "relibra.planners.reorder_only.ReorderOnlyPlanner"
_REPLICATE_ONLY = "relibra.planners.compose.relibra_replicate_only"
_ULTRAEP = "baselines.ultraep.UltraEPPlanner"

CARDS: Final[tuple[PlannerCard, ...]] = (
    # NOTE: the coloured cards are in figure order: the paper's baselines, the online balancers, ReLibra's
    # ablations and variants, ForeMoE, the bounds. Colours: ReLibra's variants in blues and purples (the
    # recommended configuration darkest), the online balancers in greens and cyan, the paper's baselines in
    # grey, brown and olive, ForeMoE in red. Then the variants and references without a colour of their own
    # (a husl hue), labelled by their name.
    PlannerCard(
        name="megatron",
        label="Megatron-LM",
        family="static",
        settings=_MEGATRON,
        information=("none",),
        grids=(
            "ablation",
            "comm_sensitivity",
            "comm_sensitivity_overall",
            "datasets",
            "ep_scaling",
            "nvl72",
            "overall",
            "peer",
            "quick_peer",
            "real_trace",
            "whole_step_shift",
        ),
        colour=("colorblind", 7),
        node=True,
    ),
    PlannerCard(
        name="round_robin",
        label="round-robin",
        family="static",
        settings="baselines.round_robin.RoundRobinPlanner",
        information=("none",),
        colour=("dark", 5),
        node=True,
    ),
    PlannerCard(
        name="popfetcher",
        label="PopFetcher",
        family="static",
        settings="baselines.popfetcher.PopFetcherPlanner",
        information=("history", "routed_microbatch"),
        grids=(
            "comm_sensitivity_overall",
            "overall",
            "peer",
            "real_trace",
        ),
        colour=("colorblind", 5),
        node=True,
    ),
    PlannerCard(
        name="eplb",
        label="EPLB+",
        family="static",
        settings=_EPLB,
        information=("oracle_batch",),
        grids=(
            "comm_sensitivity_overall",
            "overall",
            "peer",
            "quick_peer",
            "real_trace",
            "whole_step_shift",
        ),
        colour=("colorblind", 8),
        node=True,
    ),
    PlannerCard(
        name="lplb",
        label="LPLB+",
        family="static",
        settings="baselines.lplb.LplbPlanner",
        information=("oracle_batch", "oracle_microbatch"),
        grids=(
            "comm_sensitivity_overall",
            "overall",
            "peer",
            "real_trace",
        ),
        colour=("dark", 8),
        node=True,
    ),
    PlannerCard(
        name="llep",
        label="LLEP",
        family="online",
        settings="baselines.llep.LlepPlanner",
        information=("routed_microbatch",),
        grids=(
            "datasets",
            "ep_scaling",
            "nvl72",
            "overall",
            "peer",
            "whole_step_shift",
        ),
        colour=("colorblind", 2),
        node=True,
    ),
    PlannerCard(
        name="ultraep",
        label="UltraEP",
        family="online",
        settings=_ULTRAEP,
        information=("routed_microbatch",),
        grids=(
            "datasets",
            "ep_scaling",
            "nvl72",
            "overall",
            "peer",
            "whole_step_shift",
        ),
        colour=("colorblind", 9),
        node=True,
    ),
    PlannerCard(
        name="moonep",
        label="MoonEP",
        family="online",
        settings="baselines.moonep.MoonEPPlanner",
        information=("routed_microbatch",),
        grids=(
            "datasets",
            "ep_scaling",
            "nvl72",
            "overall",
            "peer",
        ),
        colour=("dark", 2),
        node=True,
    ),
    PlannerCard(
        name="echo",
        label="ECHO",
        family="online",
        settings="baselines.echo.EchoPlanner",
        information=("routed_microbatch",),
        grids=(
            "nvl72",
            "overall",
            "peer",
        ),
        colour=("pastel", 2),
        node=True,
    ),
    PlannerCard(
        name="relibra_reorder_no_locality",
        label="+ inter-batch reordering (placement only)",
        family="replay",
        settings=_REORDER_ONLY,
        information=("oracle_batch",),
        grids=("ablation",),
        colour=("pastel", 4),
        variant_of="relibra_reorder_only",
    ),
    PlannerCard(
        name="relibra_reorder_only",
        label="+ locality round (the paper's + inter-batch reordering)",
        family="replay",
        settings=_REORDER_ONLY,
        information=("oracle_batch",),
        grids=("ablation",),
        colour=("colorblind", 4),
    ),
    PlannerCard(
        name="relibra_replicate_only",
        label="+ intra-batch replication only",
        family="replay",
        settings=_REPLICATE_ONLY,
        information=("oracle_microbatch",),
        grids=(
            "comm_sensitivity",
            "comm_sensitivity_overall",
            "datasets",
            "ep_scaling",
            "nvl72",
            "overall",
            "peer",
            "real_trace",
        ),
        colour=("pastel", 0),
    ),
    PlannerCard(
        name="relibra",
        label="ReLibra (paper)",
        family="replay",
        settings=_RELIBRA,
        information=("oracle_batch", "oracle_microbatch"),
        grids=(
            "ablation",
            "comm_sensitivity",
            "comm_sensitivity_overall",
            "datasets",
            "ep_scaling",
            "nvl72",
            "overall",
            "overhead",
            "peer",
            "real_trace",
            "whole_step_shift",
        ),
        colour=("colorblind", 0),
    ),
    PlannerCard(
        name="relibra_balance",
        label="ReLibra (balance-first)",
        family="replay",
        settings=_RELIBRA,
        information=("oracle_batch", "oracle_microbatch"),
        grids=(
            "datasets",
            "ep_scaling",
        ),
        colour=("colorblind", 6),
        variant_of="relibra",
    ),
    PlannerCard(
        name="relibra_portfolio",
        label="ReLibra (recommended)",
        family="replay",
        settings="relibra.planners.portfolio.portfolio",
        information=("oracle_batch", "oracle_microbatch", "history", "previous"),
        grids=(
            "ablation",
            "comm_sensitivity",
            "comm_sensitivity_overall",
            "datasets",
            "ep_scaling",
            "overall",
            "overhead",
            "peer",
            "quick_peer",
            "real_trace",
        ),
        colour=("dark", 0),
    ),
    PlannerCard(
        name="foremoe",
        label="ForeMoE",
        family="replay",
        settings="baselines.foremoe.ForeMoEPlanner",
        information=("oracle_microbatch",),
        grids=(
            "datasets",
            "ep_scaling",
            "nvl72",
            "overall",
            "peer",
        ),
        colour=("colorblind", 3),
        node=True,
    ),
    PlannerCard(
        name="relibra_no_locality",
        label="ReLibra without its locality round",
        family="replay",
        settings=_RELIBRA,
        information=("oracle_batch", "oracle_microbatch"),
        colour=("dark", 4),
        variant_of="relibra",
    ),
    PlannerCard(
        name="force_balanced",
        label="force-balanced",
        family="bound",
        settings="baselines.force_balanced.force_balanced",
        information=("none",),
        grids=(
            "nvl72",
            "overall",
            "peer",
            "quick_peer",
            "real_trace",
            "whole_step_shift",
        ),
        colour=("dark", 7),
    ),
    PlannerCard(
        name="balanced",
        label="Balanced",
        family="bound",
        settings="baselines.balanced.BalancedBound",
        information=("oracle_microbatch",),
        grids=(
            "comm_sensitivity",
            "comm_sensitivity_overall",
            "nvl72",
            "overall",
            "peer",
            "real_trace",
        ),
        colour=("colorblind", 1),
        node=True,
    ),
    PlannerCard(
        name="eplb_global",
        label="eplb_global",
        family="static",
        settings=_EPLB,
        information=("oracle_batch",),
        variant_of="eplb",
    ),
    PlannerCard(
        name="eplb_history",
        label="eplb_history",
        family="static",
        settings=_EPLB,
        information=("history",),
        grids=("peer",),
        variant_of="eplb",
    ),
    PlannerCard(
        name="eplb_periodic",
        label="eplb_periodic",
        family="static",
        settings="baselines.eplb_periodic.EplbPeriodicPlanner",
        information=("history", "previous"),
        grids=("peer",),
        node=True,
    ),
    PlannerCard(
        name="relibra_keep_placement",
        label="relibra_keep_placement",
        family="replay",
        settings=_REPLICATE_ONLY,
        information=("oracle_microbatch", "previous"),
        variant_of="relibra_replicate_only",
    ),
    PlannerCard(
        name="relibra_milp",
        label="relibra_milp",
        family="replay",
        settings="relibra.planners.compose.relibra_milp",
        information=("oracle_microbatch",),
    ),
    PlannerCard(
        name="ultraep_tuned",
        label="ultraep_tuned",
        family="online",
        settings=_ULTRAEP,
        information=("routed_microbatch",),
        variant_of="ultraep",
    ),
)
"""Every planner of the suite, one card each (``planner=NAME`` accepts exactly these names)."""


def _by_name() -> dict[str, PlannerCard]:
    out: dict[str, PlannerCard] = {}
    for c in CARDS:
        if c.name in out:
            raise ValueError(f"planner card {c.name} is registered twice")
        out[c.name] = c
    return out


_BY_NAME: Final[dict[str, PlannerCard]] = _by_name()


def card(name: str) -> PlannerCard:
    """The card of planner ``name``; a name no card holds is refused with the registered names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"planner {name!r} is not registered; registered: {', '.join(_BY_NAME)}") from None


def names(family: Family | None = None) -> tuple[str, ...]:
    """Registered planner names in registry order (of ``family`` only, when given)."""
    return tuple(c.name for c in CARDS if family is None or c.family == family)


def labels() -> dict[str, str]:
    """Planner name -> display label, every card."""
    return {c.name: c.label for c in CARDS}


def label(planner: str) -> str:
    """The display label of ``planner`` (the name itself for a planner no card holds: a store written by
    another version of the suite may hold one)."""
    found = _BY_NAME.get(planner)
    return planner if found is None else found.label


def colours() -> dict[str, tuple[str, int]]:
    """Planner name -> (seaborn palette, index), the cards that have a colour."""
    return {c.name: c.colour for c in CARDS if c.colour is not None}


def figure_order() -> list[str]:
    """The order planners are drawn in: the coloured cards in registry order."""
    return [c.name for c in CARDS if c.colour is not None]


def in_grid(grid: str) -> tuple[str, ...]:
    """The planners preset ``grid`` compares (the cards whose ``grids`` name it), in registry order; a grid
    no card names is refused."""
    found = tuple(c.name for c in CARDS if grid in c.grids)
    if not found:
        known = sorted({g for c in CARDS for g in c.grids})
        raise KeyError(f"no planner card names the grid {grid!r}; grids the cards name: {', '.join(known)}")
    return found

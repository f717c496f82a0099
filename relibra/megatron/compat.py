"""The megatron-core releases ``relibra.megatron`` runs on, and every API difference between them.

Proven releases (docs/megatron.md): **0.16.1** (the last for Python 3.11: the default environment, ``pip
install '.[megatron]'``) and **0.19.2** (Python >= 3.12: ``pip install '.[megatron19]'``, ``make
test-megatron``). Any other release is refused by :func:`megatron_api` with one message, before a layer is
built: the adapter wraps Megatron's router and reads its dispatcher's internals, so an unproven release is
not assumed to match either. Every other module of the adapter reads the differences from the
:class:`MegatronApi` of the installed release and nowhere else; each field names the release it holds for
and the Megatron source that shows it (files under ``megatron/core/transformer/moe/`` of each wheel).

What stays the same in both (and the adapter relies on): ``RouterReplay`` (``router_replay.py``: the
actions, ``set_target_indices``, ``get_recorded_indices``, the class-level instance list), the router
call ``router(hidden_states, padding_mask) -> (probs, routing_map)``, ``ModuleSpec`` experts built as
``SequentialMLP(num_local_experts, config, submodules, pg_collection)``, the ``alltoall`` dispatcher's
split sizes copied through ``token_dispatcher.maybe_move_tensor_to_cpu`` on a ``torch.cuda`` side stream,
and the distributed optimizer's ``_get_main_param_and_optimizer_states``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = [
    "SUPPORTED",
    "MegatronApi",
    "UnsupportedMegatronVersion",
    "installed_version",
    "megatron_api",
]


@dataclass(frozen=True)
class MegatronApi:
    """What differs between the supported megatron-core releases."""

    version: str
    """The release, e.g. ``"0.19.2"``."""
    python: str
    """The oldest Python the release installs on (its wheel's ``Requires-Python``)."""
    router_builder_takes_is_mtp_layer: bool
    """0.19.2: ``MoELayer.__init__`` calls ``submodules.router(config=..., pg_collection=...,
    is_mtp_layer=...)`` and ``TopKRouter`` takes ``is_mtp_layer`` (``moe_layer.py``, ``router.py``);
    0.16.1 passes ``config`` and ``pg_collection`` only."""
    te_general_gemm_missing_without_te: bool
    """0.16.1: ``moe_utils.te_general_gemm`` is imported inside a ``try`` that binds nothing when
    Transformer Engine is absent, yet ``RouterGatingLinearFunction`` reads it unconditionally, so the CPU
    patches define it as None (``relibra.megatron.cpu_patches``). 0.19.2 binds it to None itself without
    Transformer Engine (``moe_utils.py``'s ``else`` branch): no patch."""
    replay_bypassing_balancing: tuple[str, ...]
    """``moe_router_load_balancing_type`` values whose routing ignores ``RouterReplay``: ``sinkhorn`` in
    both (``TopKRouter.routing`` calls ``sinkhorn_load_balancing``); 0.19.2 adds ``quantile_balancing``,
    whose ``TopKRouter.quantile_balancing`` picks its own top-k and calls
    ``topk_routing_with_score_function`` with ``precomputed_indices`` and no ``router_replay``."""


SUPPORTED: dict[str, MegatronApi] = {
    api.version: api
    for api in (
        MegatronApi(
            version="0.16.1",
            python="3.10",
            router_builder_takes_is_mtp_layer=False,
            te_general_gemm_missing_without_te=True,
            replay_bypassing_balancing=("sinkhorn",),
        ),
        MegatronApi(
            version="0.19.2",
            python="3.12",
            router_builder_takes_is_mtp_layer=True,
            te_general_gemm_missing_without_te=False,
            replay_bypassing_balancing=("sinkhorn", "quantile_balancing"),
        ),
    )
}
"""The proven releases (pyproject.toml's ``megatron`` and ``megatron19`` extras pin them)."""


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not a release the adapter is proven on."""


def installed_version() -> str:
    """The installed megatron-core release, e.g. ``"0.19.2"`` (``megatron.core.package_info.VERSION``,
    without the ``+<git hash>`` a source checkout appends to ``__version__``)."""
    from megatron.core import package_info

    major, minor, patch, pre = package_info.VERSION[:4]
    return f"{major}.{minor}.{patch}{pre}"


def api_for(version: str) -> MegatronApi:
    """The :class:`MegatronApi` of ``version``; raises :class:`UnsupportedMegatronVersion` for any other."""
    api = SUPPORTED.get(version)
    if api is None:
        proven = ", ".join(f"{v} (Python >= {a.python})" for v, a in SUPPORTED.items())
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is installed; relibra.megatron supports only the releases it is "
            f"proven on: {proven}. Install one: pip install '.[megatron]' (0.16.1) or "
            "pip install '.[megatron19]' (0.19.2); docs/megatron.md"
        )
    return api


@functools.cache
def megatron_api() -> MegatronApi:
    """The :class:`MegatronApi` of the installed megatron-core (checked once per process)."""
    return api_for(installed_version())

"""What moves with an expert row of a Megatron model: its weights, its gradient and the optimizer's copies.

:func:`row_state_tensors` lists, for one expert parameter (a home row's ``linear_fc1`` or ``linear_fc2``
weight), every tensor that belongs to that expert and must travel with it when the adapter moves the
expert to another rank (:meth:`~relibra.megatron.adapter.MegatronPlanAdapter.apply_placement`):

* the weights (``param.data``);
* the gradient: ``param.grad``, or Megatron DDP's ``param.main_grad`` (a view of DDP's gradient buffer,
  where Megatron keeps gradients);
* the optimizer's copies, by optimizer:

  - a ``torch.optim.Optimizer``: the state tensors of the parameter's shape (Adam's moments), keyed by the
    parameter (:func:`relibra.executors.reorder_ops.param_state_tensors`);
  - Megatron-core's ``DistributedOptimizer`` (what verl's Megatron engine builds, alone or inside a
    ``ChainedOptimizer``, one per parameter kind): the fp32 **main parameter** (the master weights that the
    next step writes back into the bf16 row) and its state tensors (``exp_avg``, ``exp_avg_sq``), read
    through the optimizer's own ``_get_main_param_and_optimizer_states``. Left behind, the next step would
    overwrite the moved row with the old expert's master weights. Supported when every expert parameter is
    whole on its rank (expert-data-parallel size 1); a shard cannot follow a row into another row's range,
    so a larger group, and the precision-aware optimizer (whose states are scaled copies), are refused;
  - any other Megatron optimizer is refused by name rather than left unmoved.

Every rank of an EP group holds the same structure, so sender and receiver list the same tensors, shapes
and dtypes for a row.
"""

from __future__ import annotations

from typing import Any

import torch

from relibra.executors.reorder_ops import param_state_tensors


def main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Megatron DDP's gradient of ``param`` (a view of DDP's gradient buffer), where DDP keeps it: its
    backward hook adds ``param.grad`` into it and clears ``param.grad`` (or the GEMM writes it there
    directly); None outside DDP."""
    main = param.__dict__.get("main_grad")
    return main if isinstance(main, torch.Tensor) else None


class OptimizerStateError(ValueError):
    """The optimizer keeps copies of the expert rows that the adapter cannot move with them."""


def _megatron_optimizers(optimizer: Any) -> list[Any] | None:
    """The optimizers inside a Megatron-core optimizer, or None when ``optimizer`` is not one."""
    try:
        from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
    except ImportError:
        return None
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    if isinstance(optimizer, MegatronOptimizer):
        return [optimizer]
    return None


def _distributed_state(optimizer: Any, param: torch.nn.Parameter) -> list[torch.Tensor]:
    """The main parameter and state tensors of ``param`` in the distributed optimizer that holds it."""
    if optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        raise OptimizerStateError(
            "optimizer config use_precision_aware_optimizer=true: its states are scaled copies that the "
            "adapter cannot move in place; moving experts needs it off"
        )
    group = optimizer.data_parallel_group.size()
    if group != 1:
        raise OptimizerStateError(
            f"the distributed optimizer shards the expert parameters over an expert-data-parallel group "
            f"of {group} ranks; moving experts needs every expert row whole on its rank (EDP size 1)"
        )
    tensors = optimizer._get_main_param_and_optimizer_states(param)
    return [v for _, v in sorted(tensors.items()) if torch.is_tensor(v) and v.numel() == param.numel()]


def row_state_tensors(param: torch.nn.Parameter, optimizer: Any | None) -> list[torch.Tensor]:
    """Every tensor that moves with expert parameter ``param`` under ``optimizer`` (module doc), in an order
    that is the same on every rank. Raises :class:`OptimizerStateError` for state it cannot move."""
    megatron = _megatron_optimizers(optimizer)
    if megatron is None:
        out = param_state_tensors(param, optimizer)
    else:
        from megatron.core.optimizer import DistributedOptimizer

        other = [type(o).__name__ for o in megatron if not isinstance(o, DistributedOptimizer)]
        if other:
            raise OptimizerStateError(
                f"optimizer {type(optimizer).__name__} holds {', '.join(other)}: moving experts under "
                "Megatron's non-distributed optimizers is not supported (their master weights would stay "
                "behind); use the distributed optimizer (verl: actor.megatron.use_distributed_optimizer=true)"
            )
        out = [param.data] if param.grad is None else [param.data, param.grad]
        for o in megatron:
            if any(param in buffer.param_index_map for buffer in o.buffers):
                out += _distributed_state(o, param)
    main = main_grad(param)
    if param.grad is None and main is not None:
        out.insert(1, main)
    return out

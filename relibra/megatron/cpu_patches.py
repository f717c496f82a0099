"""The patches megatron-core needs to run its ``MoELayer`` on CPU with gloo, applied only on CPU.

Megatron-core is written for CUDA. With ``use_cpu_initialization=True``, float32, ``SequentialMLP`` experts
and the ``alltoall`` token dispatcher, its MoE layer runs forward and backward on CPU once four names that
would otherwise raise on a machine without CUDA are given CPU stand-ins (0.16.1 needs all four, 0.19.2 all
but the third: :mod:`relibra.megatron.compat`):

1. ``torch.cuda.Stream`` / ``current_stream`` / ``stream``: the alltoall dispatcher copies its split
   sizes device-to-host on a side stream (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``) and
   creates that stream in its constructor. On CPU every copy is synchronous, so one inert stream object
   stands in for all streams.
2. ``torch.cuda.current_device``: ``TopKRouter.gating`` moves the router weight to it, and the
   all-to-all and gather wrappers in ``tensor_parallel.mappings`` allocate their outputs on it. On CPU it
   names the CPU.
3. ``moe_utils.te_general_gemm``: imported from Transformer Engine inside a ``try`` in 0.16.1 and read
   unconditionally by ``RouterGatingLinearFunction``; without Transformer Engine the name is missing. Set
   to ``None``, the router takes its plain ``torch.mm`` path. 0.19.2 sets it to ``None`` itself
   (:attr:`~relibra.megatron.compat.MegatronApi.te_general_gemm_missing_without_te`).
4. ``token_dispatcher.maybe_move_tensor_to_cpu``: leaves CPU tensors as they are, so the dispatcher
   would hand gloo's ``all_to_all_single`` split sizes as tensors. The stand-in also turns CPU tensors into
   numpy when asked (``as_numpy=True``), as it does for CUDA tensors.

Every patch replaces a name that raises (or is missing) without CUDA, so applying them cannot change a
working code path; :func:`apply_cpu_patches` does nothing when CUDA is available.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from relibra.megatron.compat import MegatronApi, megatron_api

__all__ = [
    "CPU_PATCHES",
    "applied_patches",
    "apply_cpu_patches",
    "cpu_patches",
    "patches_for",
    "remove_cpu_patches",
]


class _CpuStream:
    """An inert stand-in for ``torch.cuda.Stream``: on CPU every copy has finished when it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuStream:
        return self

    def query(self) -> bool:
        return True


_STREAM = _CpuStream()


def _current_stream(device: Any = None) -> _CpuStream:
    return _STREAM


def _stream(stream: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _current_device() -> torch.device:
    return torch.device("cpu")


def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` for CPU tensors: numpy when ``as_numpy`` (split sizes)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


@dataclass(frozen=True)
class _Patch:
    name: str
    reason: str
    target: Callable[[], Any]
    """Returns the object that holds the attribute."""
    attribute: str
    value: Any
    only_if: str | None = None
    """A boolean field of :class:`~relibra.megatron.compat.MegatronApi`: the patch is needed only in the
    releases where it is true (None: in every release)."""

    def needed(self, api: MegatronApi) -> bool:
        return self.only_if is None or bool(getattr(api, self.only_if))


def _token_dispatcher() -> Any:
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher


def _moe_utils() -> Any:
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


CPU_PATCHES: tuple[_Patch, ...] = (
    _Patch(
        "cuda_stream",
        "alltoall dispatcher creates a DtoH side stream",
        lambda: torch.cuda,
        "Stream",
        _CpuStream,
    ),
    _Patch(
        "cuda_current_stream",
        "alltoall dispatcher compares and waits on the current stream",
        lambda: torch.cuda,
        "current_stream",
        _current_stream,
    ),
    _Patch(
        "cuda_stream_context",
        "alltoall dispatcher copies split sizes under a stream context",
        lambda: torch.cuda,
        "stream",
        _stream,
    ),
    _Patch(
        "cuda_current_device",
        "TopKRouter.gating moves the router weight to it; all-to-all outputs are allocated on it",
        lambda: torch.cuda,
        "current_device",
        _current_device,
    ),
    _Patch(
        "te_general_gemm",
        "megatron-core 0.16.1 reads moe_utils.te_general_gemm, defined only with Transformer Engine",
        _moe_utils,
        "te_general_gemm",
        None,
        only_if="te_general_gemm_missing_without_te",
    ),
    _Patch(
        "split_sizes_to_numpy",
        "gloo's all_to_all_single needs split sizes as a sequence of ints, not a tensor",
        _token_dispatcher,
        "maybe_move_tensor_to_cpu",
        _maybe_move_tensor_to_cpu,
    ),
)
"""Every patch, with the reason it is needed (module docstring)."""


def patches_for(api: MegatronApi) -> tuple[_Patch, ...]:
    """The patches of :data:`CPU_PATCHES` that the release ``api`` needs."""
    return tuple(p for p in CPU_PATCHES if p.needed(api))


_MISSING = object()
_saved: dict[str, Any] = {}


def applied_patches() -> tuple[str, ...]:
    """Names of the patches applied now."""
    return tuple(_saved)


def apply_cpu_patches(force: bool = False) -> tuple[str, ...]:
    """Apply the patches the installed release needs (:func:`patches_for`) unless CUDA is available
    (``force`` applies them anyway). Refuses an unsupported release (:func:`megatron_api`).

    Idempotent. Returns the names of the patches in place afterwards.
    """
    api = megatron_api()
    if torch.cuda.is_available() and not force:
        return applied_patches()
    for patch in patches_for(api):
        if patch.name in _saved:
            continue
        holder = patch.target()
        _saved[patch.name] = getattr(holder, patch.attribute, _MISSING)
        setattr(holder, patch.attribute, patch.value)
    return applied_patches()


def remove_cpu_patches() -> None:
    """Restore every patched name to what it was before :func:`apply_cpu_patches`."""
    for patch in reversed(CPU_PATCHES):
        if patch.name not in _saved:
            continue
        holder, old = patch.target(), _saved.pop(patch.name)
        if old is _MISSING:
            delattr(holder, patch.attribute)
        else:
            setattr(holder, patch.attribute, old)


@contextlib.contextmanager
def cpu_patches(force: bool = False) -> Iterator[tuple[str, ...]]:
    """Context manager form of :func:`apply_cpu_patches` / :func:`remove_cpu_patches`."""
    already = set(applied_patches())
    names = apply_cpu_patches(force=force)
    try:
        yield names
    finally:
        if not already:
            remove_cpu_patches()

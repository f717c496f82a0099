"""Routing capture for HF transformers MoE models: every token's top-k experts per MoE layer, recorded
while the model runs (``generate()`` or a plain forward), emitted in the routing trace format.

Supported model classes (transformers 5.x): Qwen3-MoE, OLMoE and Mixtral. Their MoE block (``layer.mlp``)
holds a top-k router (``layer.mlp.gate``) whose forward returns ``(router_logits, router_scores,
router_indices)`` with ``router_indices`` int64 ``[B * T, k]``. :class:`RouteCapture` puts a forward
pre-hook on every MoE block (to learn the step's ``[B, T]``) and a forward hook on its router (to read
``router_indices``); the model is never run a second time. Layers without experts (Qwen3-MoE's
``mlp_only_layers``) are skipped, so the trace's layer axis counts MoE layers only.

One capture covers one ``generate()`` call (or one forward): the prefill step covers positions
``0..P-1`` of the (left-padded) prompt, each decode step one more position per row. The last generated
token of a sample is never fed to the model during ``generate()``, so it has no route; a captured sample
therefore holds the routes of its tokens except the last one (the prompt's real tokens first when
``include_prompt``). This is the same convention as an inference engine's routed-experts output.

Typical use on the rollout side::

    with RouteCapture(model) as cap:
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=n)
    trace = cap.trace(out, prompt_mask=mask, include_prompt=False)   # a RoutingTrace, one batch

The replay premise (training recomputes the same routes) is checked by :func:`route_mismatch` over a
training-style forward captured the same way (:meth:`RouteCapture.forward_routes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from relibra.trace.format import RoutingTrace

__all__ = [
    "CaptureError",
    "CapturedSample",
    "RouteCapture",
    "find_moe_routers",
    "response_lengths",
    "route_mismatch",
]

_ROUTER_CLASSES = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
    ("transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"),
)
"""(module, class) of the router of every supported model family."""


class CaptureError(RuntimeError):
    """The model, the capture state or the generation output does not fit what the capture expects."""


def _router_types() -> tuple[type, ...]:
    import importlib

    found = []
    for module_name, cls_name in _ROUTER_CLASSES:
        try:
            found.append(getattr(importlib.import_module(module_name), cls_name))
        except (ImportError, AttributeError):  # NOTE: an older transformers lacks this family; skip it.
            continue
    return tuple(found)


def find_moe_routers(model: Any) -> list[tuple[int, Any, Any]]:
    """The MoE layers of ``model`` in order: ``(decoder_layer_index, moe_block, router)`` per MoE layer.

    Raises:
        CaptureError: when ``model`` has no decoder layers or none of them holds a supported router.
    """
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise CaptureError(
            f"{type(model).__name__} has no `.model.layers` (or `.layers`); pass a Qwen3-MoE, OLMoE or "
            "Mixtral causal-LM or its base model"
        )
    router_types = _router_types()
    found = []
    for idx, layer in enumerate(layers):
        block = getattr(layer, "mlp", None)
        router = getattr(block, "gate", None)
        if router is not None and isinstance(router, router_types):
            found.append((idx, block, router))
    if not found:
        names = ", ".join(cls for _, cls in _ROUTER_CLASSES)
        raise CaptureError(f"{type(model).__name__} holds no supported MoE router (looked for {names})")
    return found


@dataclass(frozen=True)
class CapturedSample:
    """The routes of one sample (one row of the generation batch)."""

    experts: np.ndarray
    """int16 [T_s, L, k]: routed experts of the sample's recorded tokens, in sequence order."""
    start: int
    """Position (in the unpadded sequence, prompt first) of the first recorded token."""
    prompt_tokens: int
    """Real (non-pad) prompt tokens of the sample."""
    response_tokens: int
    """Generated tokens of the sample up to and including its first end-of-sequence token."""


def response_lengths(generated: np.ndarray, eos_token_id: int | Sequence[int] | None) -> np.ndarray:
    """int64 [B]: generated tokens per row up to and including the first end-of-sequence token.

    Args:
        generated: int [B, N] the generated part of ``generate()``'s output (prompt columns removed).
        eos_token_id: one id, several, or None (then every row runs to ``N``).
    """
    gen = np.asarray(generated)
    num_rows, num_new = gen.shape
    if eos_token_id is None or num_new == 0:
        return np.full(num_rows, num_new, dtype=np.int64)
    eos = np.atleast_1d(np.asarray(eos_token_id))
    is_eos = np.isin(gen, eos)
    first = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, num_new)
    return first.astype(np.int64)


class RouteCapture:
    """Context manager recording the routes of every forward of ``model`` while it is active.

    Each forward is one *step*; steps are stored per MoE layer as int16 ``[B, T, k]`` arrays on the CPU.
    Entering clears earlier steps; hooks are removed on exit (also on error).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._moe = find_moe_routers(model)
        self._handles: list[Any] = []
        self._shape: list[tuple[int, int] | None] = [None] * len(self._moe)
        self._steps: list[list[np.ndarray]] = [[] for _ in self._moe]

    # -- recording -----------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """MoE layers recorded (``L`` of the trace)."""
        return len(self._moe)

    @property
    def moe_layer_ids(self) -> list[int]:
        """Decoder-layer index of each recorded MoE layer."""
        return [idx for idx, _, _ in self._moe]

    @property
    def num_experts(self) -> int:
        return int(self._moe[0][2].num_experts)

    @property
    def top_k(self) -> int:
        return int(self._moe[0][2].top_k)

    @property
    def num_steps(self) -> int:
        return len(self._steps[0])

    def __enter__(self) -> RouteCapture:
        self.clear()
        for slot, (_, block, router) in enumerate(self._moe):
            self._handles.append(block.register_forward_pre_hook(self._block_hook(slot)))
            self._handles.append(router.register_forward_hook(self._router_hook(slot)))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        """Forget every recorded step."""
        self._shape = [None] * len(self._moe)
        self._steps = [[] for _ in self._moe]

    def _block_hook(self, slot: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...]) -> None:
            hidden = args[0]
            if hidden.dim() != 3:
                raise CaptureError(f"MoE block input must be [B, T, H], got shape {tuple(hidden.shape)}")
            self._shape[slot] = (int(hidden.shape[0]), int(hidden.shape[1]))

        return hook

    def _router_hook(self, slot: int) -> Any:
        def hook(_module: Any, _args: tuple[Any, ...], output: Any) -> None:
            shape = self._shape[slot]
            if shape is None:
                raise CaptureError(f"router of MoE layer slot {slot} ran outside its MoE block")
            indices = output[2].detach()
            self._steps[slot].append(
                indices.reshape(shape[0], shape[1], -1).to("cpu").numpy().astype(np.int16)
            )
            self._shape[slot] = None

        return hook

    # -- results -------------------------------------------------------------------------------------

    def positions(self) -> np.ndarray:
        """int16 [B, P, L, k]: routes of every recorded position of every row (pads included).

        ``P`` is the number of positions the model ran: ``prompt + new_tokens - 1`` after ``generate()``,
        the sequence length after one forward.
        """
        if self.num_steps == 0:
            raise CaptureError("nothing was recorded: run the model inside `with RouteCapture(model):`")
        if len({len(steps) for steps in self._steps}) != 1:
            raise CaptureError("MoE layers recorded different step counts (a forward was interrupted)")
        rows = {step.shape[0] for steps in self._steps for step in steps}
        if len(rows) != 1:
            raise CaptureError(
                f"steps have different batch sizes {sorted(rows)}: one capture covers one generate() call "
                "without beams or num_return_sequences > 1"
            )
        per_layer = [np.concatenate(steps, axis=1) for steps in self._steps]  # L x [B, P, k]
        return np.stack(per_layer, axis=2)

    def forward_routes(self, attention_mask: Any) -> list[np.ndarray]:
        """Routes of one captured forward over right- or left-padded rows, real tokens only.

        Args:
            attention_mask: [B, T] (tensor or array), 1 on real tokens.
        Returns:
            per row, int16 [T_b, L, k] in position order.
        """
        routes = self.positions()
        mask = np.asarray(_to_numpy(attention_mask)).astype(bool)
        if mask.shape != routes.shape[:2]:
            raise CaptureError(
                f"attention_mask has shape {mask.shape}, the capture covers {routes.shape[:2]}"
            )
        return [routes[b, mask[b]] for b in range(mask.shape[0])]

    def samples(
        self,
        sequences: Any,
        prompt_mask: Any,
        include_prompt: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> list[CapturedSample]:
        """Per-sample routes after one ``generate()`` call inside this capture.

        Args:
            sequences: [B, P + N] ``generate()``'s output (left-padded prompt, then generated tokens).
            prompt_mask: [B, P] the prompt's attention mask (1 on real tokens).
            include_prompt: also emit the routes of the prompt's real tokens (the prefill).
            eos_token_id: ends each response at its first occurrence; defaults to the model's
                ``generation_config.eos_token_id``.
        Returns:
            one :class:`CapturedSample` per row; its last token (never fed to the model) has no route.
        """
        seqs = np.asarray(_to_numpy(sequences))
        mask = np.asarray(_to_numpy(prompt_mask)).astype(bool)
        if seqs.ndim != 2 or mask.ndim != 2 or seqs.shape[0] != mask.shape[0]:
            raise CaptureError(
                f"sequences [B, P+N] and prompt_mask [B, P] disagree: {seqs.shape}, {mask.shape}"
            )
        routes = self.positions()
        num_rows, prompt_len = mask.shape
        if routes.shape[0] != num_rows or routes.shape[1] != seqs.shape[1] - 1:
            raise CaptureError(
                f"the capture covers {routes.shape[:2]} (rows, positions) but generate() returned "
                f"{seqs.shape}; expected positions == sequence length - 1 (one generate() per capture)"
            )
        if eos_token_id is None:
            gen_cfg = getattr(self.model, "generation_config", None)
            eos_token_id = getattr(gen_cfg, "eos_token_id", None)
        lengths = response_lengths(seqs[:, prompt_len:], eos_token_id)
        out = []
        for b in range(num_rows):
            real = np.flatnonzero(mask[b])
            # Recorded positions: the real prompt tokens (optional), then the response except its last token.
            response = np.arange(prompt_len, prompt_len + lengths[b] - 1)
            cols = np.concatenate([real, response]) if include_prompt else response
            out.append(
                CapturedSample(
                    experts=routes[b, cols],
                    start=0 if include_prompt else int(real.size),
                    prompt_tokens=int(real.size),
                    response_tokens=int(lengths[b]),
                )
            )
        return out

    def trace(
        self,
        sequences: Any,
        prompt_mask: Any,
        include_prompt: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        model_name: str | None = None,
    ) -> RoutingTrace:
        """The captured samples as a one-batch :class:`~relibra.trace.format.RoutingTrace`.

        Samples with no recorded token (a one-token response without its prompt) are left out; their row
        indices are listed in ``meta["dropped_rows"]``. ``meta["rows"]`` maps trace samples to rows.
        """
        samples = self.samples(sequences, prompt_mask, include_prompt, eos_token_id)
        kept = [b for b, s in enumerate(samples) if s.experts.shape[0] > 0]
        if not kept:
            raise CaptureError("every captured sample is empty; nothing to write as a trace")
        lens = np.array([samples[b].experts.shape[0] for b in kept], dtype=np.int64)
        config = getattr(self.model, "config", None)
        meta = {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_layers": self.num_layers,
            "model": model_name or str(getattr(config, "model_type", type(self.model).__name__)),
            "source": "hf-transformers-capture",
            "include_prompt": bool(include_prompt),
            "moe_layer_ids": self.moe_layer_ids,
            "rows": kept,
            "dropped_rows": [b for b in range(len(samples)) if b not in kept],
        }
        return RoutingTrace(
            experts=np.concatenate([samples[b].experts for b in kept], axis=0),
            sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
            batch_offsets=np.array([0, len(kept)], dtype=np.int64),
            meta=meta,
        )


def route_mismatch(recorded: np.ndarray, recomputed: np.ndarray) -> float:
    """Fraction of (token, layer) routes whose top-k expert *sets* differ.

    Args:
        recorded, recomputed: int [T, L, k] routes of the same tokens.
    Returns:
        mismatch rate in [0, 1]; 0.0 means routing replay would reproduce every route.
    """
    a, b = np.asarray(recorded), np.asarray(recomputed)
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(
            f"recorded and recomputed must both be [T, L, k] of one shape, got {a.shape}, {b.shape}"
        )
    if a.size == 0:
        return 0.0
    differ = np.any(np.sort(a, axis=-1) != np.sort(b, axis=-1), axis=-1)
    return float(differ.mean())


def _to_numpy(value: Any) -> Any:
    detach = getattr(value, "detach", None)
    return detach().to("cpu").numpy() if detach is not None else value

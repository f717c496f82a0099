"""How many query-key pairs one sample's attention computes: causal, or causal inside a sliding window.

Attention work per layer follows the pairs each GPU holds (``relibra.cost.model.CostModel.attention_time``),
so the pairs are defined once, here, and every consumer reads them through :class:`AttentionSpan`: the
workload's per-GPU sums (:func:`relibra.workload.gpu_token_stats`), the balanced layout's second key
(:mod:`relibra.layout`), the locality round's attention cap (:mod:`relibra.planners.reorder.locality`) and
the pricing of a plan's sample assignment (:mod:`relibra.cost.pricing`). Every planner therefore sees the
same attention work for the same samples.

* Full causal attention over a sample of ``t`` tokens: token ``i`` (0-based) attends to ``i + 1`` keys,
  ``t (t + 1) / 2`` pairs.
* A sliding window of ``w`` keys (the query itself and the ``w - 1`` before it; Megatron-core's
  ``window_size = (w - 1, 0)``, as Megatron-Bridge sets it for gpt-oss from the Hugging Face
  ``sliding_window = w``): token ``i`` attends to ``min(i + 1, w)`` keys, ``t (t + 1) / 2`` pairs for
  ``t <= w`` and ``w (w + 1) / 2 + (t - w) w`` beyond.

A model whose layers mix both (gpt-oss alternates windowed and full layers) is priced at the mean over
its layers: ``(1 - f) full + f windowed`` with ``f`` = windowed layers / layers. That is exact for the sum
over all layers, which is what an EP-only step runs. Choice left open: a pipeline stage holds a contiguous
run of layers, so a stage's own share can differ from the mean by one layer (nine gpt-oss layers per stage
hold four or five full ones); the per-stage pricing (:mod:`relibra.cost.pipeline`) uses the mean for every
stage.

Under tensor or context parallelism a sample is held by a TP x CP group of ``n = tp * cp`` GPUs, each
holding ``1 / n`` of its tokens (:mod:`relibra.workload`); :meth:`AttentionSpan.split` gives the span of such
a rank, whose :meth:`~AttentionSpan.pairs` of a rank's ``t / n`` tokens is ``1 / n`` of the whole sample's
pairs. That is each GPU's share: a TP rank computes every query of its CP chunk for ``1 / tp`` of the heads,
and CP's ``2 cp`` chunk split (rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``) gives every CP rank the
same causal pairs, ``(2 cp - 1) C^2 + C (C + 1)`` for chunks of ``C`` tokens, the ``1 / cp`` share. Choices
left open: a sample whose length ``n`` does not divide is split into ranks of ``floor`` or ``ceil`` of
``t / n`` tokens, each priced at ``1 / n`` of the pairs of ``n`` times its length (within ``O(t)`` pairs of
the exact split); under a sliding window the chunks nearest a sample's start attend to fewer keys, so the
CP ranks' windowed pairs differ by up to one chunk's, priced at their mean.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class AttentionSpan:
    """Keys each query attends to: every earlier token of its sample, or a sliding window on some layers."""

    window: int | None = None
    """Keys per query on the windowed layers (the query included); None: no windowed layers."""
    windowed_share: float = 0.0
    """Fraction of the layers that attend inside the window, in [0, 1]."""
    parts: int = 1
    """GPUs a sample is split over (``tp * cp``, module doc); 1: whole samples."""

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window={self.window}: expected an integer >= 1 or None")
        if not 0.0 <= self.windowed_share <= 1.0:
            raise ValueError(f"windowed share={self.windowed_share}: expected a fraction in [0, 1]")
        if self.windowed_share > 0.0 and self.window is None:
            raise ValueError(f"windowed share={self.windowed_share} with no window: give the window's width")
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"attention span parts={self.parts!r}: expected an integer >= 1")

    def split(self, parts: int) -> AttentionSpan:
        """The span of one of the ``parts`` ranks a sample is split over (module doc)."""
        return replace(self, parts=parts)

    def pairs(self, lens: np.ndarray) -> np.ndarray:
        """float64 [S]: query-key pairs of one layer per sample, mean over the layers; lens int [S] (with
        ``parts > 1``: a rank's tokens of a split sample, and its share of the sample's pairs)."""
        if self.parts > 1:
            return replace(self, parts=1).pairs(np.asarray(lens, dtype=np.int64) * self.parts) / self.parts
        t = np.asarray(lens, dtype=np.int64)
        full = t * (t + 1) / 2.0
        if self.window is None or self.windowed_share == 0.0:
            return full
        w = self.window
        windowed = np.where(t <= w, full, w * (w + 1) / 2.0 + (t - w) * float(w))
        return (1.0 - self.windowed_share) * full + self.windowed_share * windowed


FULL_CAUSAL = AttentionSpan()
"""Every layer attends causally over its whole sample (every model but those with ``attention_window``)."""

"""Synthetic RL routing workloads: per-sample expert counts (or, for small cases, per-token routes).

What RL training shows and pretraining does not (issue 2): a narrow domain, samples that differ in topic,
and no auxiliary balancing loss, so the hot experts shift from one micro-batch to the next. The generative
model, per MoE layer ``l``:

1. a model-wide expert bias ``b[l, e] ~ N(0, shared_sigma)`` (the static skew every placement sees);
2. per latent topic ``z`` of each domain an affinity ``a[z, l, e] ~ N(0, affinity_sigma)`` (log-normal
   weights once exponentiated); topic ``z`` routes with ``softmax(b[l] + a[z, l])``;
3. per sample a topic mixture ``pi[s] ~ Dirichlet(topic_alpha)`` (small ``topic_alpha``: a sample sticks
   to a few topics), so its routing distribution is ``p[s, l] = sum_z pi[s, z] softmax(b[l] + a[z, l])``;
4. per batch (one RL step) the bias drifts by ``N(0, drift_sigma)`` (the policy moves slowly);
5. a response length per sample from the domain's log-normal, truncated at ``max_tokens`` (RL responses
   that hit the limit are cut: a spike at the maximum, as in long reasoning chains).

Counts at scale (:func:`generate_counts`): each token of sample ``s`` picks ``k`` DISTINCT experts, so an
expert's count is at most the sample's tokens. Exact top-k sampling (Gumbel top-k, as
:func:`generate_trace` does) costs ``O(T L E)`` per sample; instead we use its first-order marginal:
the inclusion probability of expert ``e`` is approximated by ``q[e] = min(1, c * p[e])`` with ``c`` chosen
so that ``sum_e q[e] = k`` (water-filling), the ``T * k`` slots are drawn as one multinomial over
``q / k``, and the rare counts above ``T`` are clipped and their excess redrawn among the experts with
room. Per-layer totals are exactly ``T * k`` and every count is ``<= T``; the approximation is in the
inclusion probabilities (Plackett-Luce top-k inclusion is flatter than ``k * p`` for the hottest
experts) and in ignoring the negative correlation between experts within one token, neither of which
changes per-micro-batch expert loads by more than sampling noise at ``T >= 100``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from relibra import numerics
from relibra.trace.format import RoutingTrace
from relibra.types import SampleCounts

__all__ = [
    "PRESETS",
    "DomainSpec",
    "WorkloadPreset",
    "counts_from_probs",
    "generate_counts",
    "generate_lengths",
    "generate_trace",
    "get_preset",
]


@dataclass(frozen=True)
class DomainSpec:
    """One dataset's routing and response-length shape."""

    name: str
    num_topics: int
    """Latent topics of the domain (each with its own expert affinity per layer)."""
    topic_alpha: float
    """Dirichlet concentration of a sample's topic mixture (smaller: samples stick to fewer topics)."""
    affinity_sigma: float
    """Std of a topic's log expert affinity (larger: hotter topic-specific experts)."""
    length_median: float
    """Median response length in tokens (log-normal)."""
    length_sigma: float
    """Std of the log response length."""
    min_tokens: int
    max_tokens: int
    """Responses longer than this are truncated to it."""


@dataclass(frozen=True)
class WorkloadPreset:
    """A generator preset: the domains a batch draws its samples from and the model-wide skew."""

    name: str
    domains: tuple[DomainSpec, ...]
    domain_weights: tuple[float, ...]
    """[D] probability that a sample comes from each domain (sums to 1)."""
    shared_sigma: float
    """Std of the model-wide log expert bias per layer (static skew)."""
    drift_sigma: float
    """Std of the per-batch random-walk drift of that bias (policy updates between RL steps)."""


REASONING = DomainSpec("reasoning", 12, 0.2, 1.0, 2600.0, 0.8, 64, 8192)
INSTRUCTION_FOLLOWING = DomainSpec("instruction_following", 16, 0.3, 0.9, 420.0, 0.6, 16, 4096)
CODING = DomainSpec("coding", 12, 0.25, 1.1, 1400.0, 0.7, 32, 8192)

PRESETS: dict[str, WorkloadPreset] = {
    "reasoning": WorkloadPreset("reasoning", (REASONING,), (1.0,), 0.5, 0.05),
    "instruction_following": WorkloadPreset(
        "instruction_following", (INSTRUCTION_FOLLOWING,), (1.0,), 0.5, 0.05
    ),
    "coding": WorkloadPreset("coding", (CODING,), (1.0,), 0.5, 0.05),
    "mixed": WorkloadPreset("mixed", (REASONING, INSTRUCTION_FOLLOWING, CODING), (0.4, 0.3, 0.3), 0.5, 0.05),
}
"""The paper's datasets: reasoning (DAPO-Math, GPQA), instruction following (IFBench), coding
(CodeForces), and their mixture."""


def get_preset(preset: str | WorkloadPreset) -> WorkloadPreset:
    """The preset named ``preset`` (one of :data:`PRESETS`), or ``preset`` itself."""
    if isinstance(preset, WorkloadPreset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown workload preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    numerics.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


@dataclass(frozen=True)
class _Model:
    """Latent routing parameters of one synthetic model (fixed for a seed)."""

    bias: np.ndarray
    """float64 [L, E]: model-wide log expert bias."""
    topic_logits: tuple[np.ndarray, ...]
    """per domain, float64 [Z_d, L, E]: topic log affinities."""


def _draw_model(
    preset: WorkloadPreset, num_layers: int, num_experts: int, rng: np.random.Generator
) -> _Model:
    bias = rng.normal(0.0, preset.shared_sigma, size=(num_layers, num_experts))
    topics = tuple(
        rng.normal(0.0, d.affinity_sigma, size=(d.num_topics, num_layers, num_experts))
        for d in preset.domains
    )
    return _Model(bias=bias, topic_logits=topics)


def generate_lengths(
    domain: DomainSpec, num_samples: int, rng: np.random.Generator, max_tokens: int | None = None
) -> np.ndarray:
    """int64 [S]: response lengths, log-normal around ``length_median``, truncated at the max length."""
    cap = domain.max_tokens if max_tokens is None else min(max_tokens, domain.max_tokens)
    raw = rng.lognormal(np.log(domain.length_median), domain.length_sigma, size=num_samples)
    return np.clip(np.rint(raw), min(domain.min_tokens, cap), cap).astype(np.int64)


def _sample_design(
    preset: WorkloadPreset,
    model: _Model,
    num_samples: int,
    bias: np.ndarray,
    rng: np.random.Generator,
    max_tokens: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Domains int16 [S], lengths int64 [S], routing distributions float64 [S, L, E] of one batch."""
    num_layers, num_experts = bias.shape
    domain = rng.choice(len(preset.domains), size=num_samples, p=np.asarray(preset.domain_weights))
    lengths = np.zeros(num_samples, dtype=np.int64)
    probs = np.empty((num_samples, num_layers, num_experts))
    for d, spec in enumerate(preset.domains):
        members = np.flatnonzero(domain == d)
        if members.size == 0:
            continue
        lengths[members] = generate_lengths(spec, members.size, rng, max_tokens)
        mixture = rng.dirichlet(np.full(spec.num_topics, spec.topic_alpha), size=members.size)  # [s, Z]
        topic_probs = _softmax(bias[None] + model.topic_logits[d])  # [Z, L, E]
        probs[members] = np.einsum("sz,zle->sle", mixture, topic_probs)
    return domain.astype(np.int16), lengths, probs


def _inclusion(probs: np.ndarray, top_k: int) -> np.ndarray:
    """float64 [..., E]: ``min(1, c p)`` with ``c`` such that each row sums to ``top_k`` (water-filling)."""
    q = probs * top_k
    capped = np.zeros(q.shape, dtype=bool)
    for _ in range(top_k):
        grown = (q >= 1.0) & ~capped
        if not grown.any():
            break  # NOTE: the same caps give the same q again: a fixed point
        capped |= grown
        free_mass = np.where(capped, 0.0, probs).sum(axis=-1, keepdims=True)
        room = top_k - capped.sum(axis=-1, keepdims=True)
        scale = np.divide(room, free_mass, out=np.zeros_like(free_mass), where=free_mass > 0)
        q = np.where(capped, 1.0, probs * scale)
    return q


def counts_from_probs(
    probs: np.ndarray, tokens: np.ndarray, top_k: int, rng: np.random.Generator
) -> np.ndarray:
    """int32 [S, L, E]: per-layer counts summing to ``tokens * top_k`` with every count ``<= tokens``."""
    num_experts = probs.shape[-1]
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    q = _inclusion(probs, top_k) / top_k
    q /= q.sum(axis=-1, keepdims=True)
    slots = np.broadcast_to((tokens * top_k)[:, None], probs.shape[:2])
    flat = rng.multinomial(slots, q).reshape(-1, num_experts)
    flat_cap = np.repeat(tokens, probs.shape[1])[:, None]
    q_flat = q.reshape(-1, num_experts)
    for _ in range(64):
        over = flat > flat_cap
        if not over.any():
            break
        # Clip the counts above the token count and redraw their excess among experts with room.
        excess = np.where(over, flat - flat_cap, 0).sum(axis=-1)
        np.minimum(flat, flat_cap, out=flat)
        rows = np.flatnonzero(excess)
        room_q = np.where(flat[rows] < flat_cap[rows], q_flat[rows], 0.0)
        room_q /= room_q.sum(axis=-1, keepdims=True)
        flat[rows] += rng.multinomial(excess[rows], room_q)
    else:  # pragma: no cover - the water-filled q makes more than a few rounds essentially impossible
        raise RuntimeError("could not enforce count <= tokens; increase num_experts or decrease top_k")
    return flat.reshape(probs.shape).astype(np.int32)


def _check_shape(
    num_experts: int, num_layers: int, top_k: int, num_batches: int, samples_per_batch: int
) -> None:
    for name, value in (
        ("num_experts", num_experts),
        ("num_layers", num_layers),
        ("top_k", top_k),
        ("num_batches", num_batches),
        ("samples_per_batch", samples_per_batch),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")


def _batches(
    preset: WorkloadPreset,
    num_experts: int,
    num_layers: int,
    num_batches: int,
    samples_per_batch: int,
    seed: int,
    max_tokens: int | None,
) -> Iterator[tuple[np.random.Generator, np.ndarray, np.ndarray, np.ndarray]]:
    """Yield (rng, domains, lengths, probs) per batch; the model and all draws follow from ``seed``."""
    model_seq, sample_seq = np.random.SeedSequence(seed).spawn(2)
    model = _draw_model(preset, num_layers, num_experts, np.random.default_rng(model_seq))
    rng = np.random.default_rng(sample_seq)
    bias = model.bias
    for b in range(num_batches):
        if b:
            bias = bias + rng.normal(0.0, preset.drift_sigma, size=bias.shape)
        yield (rng, *_sample_design(preset, model, samples_per_batch, bias, rng, max_tokens))


def generate_counts(
    preset: str | WorkloadPreset,
    num_experts: int,
    num_layers: int,
    top_k: int,
    num_batches: int,
    samples_per_batch: int,
    seed: int,
    max_tokens: int | None = None,
) -> SampleCounts:
    """Per-sample expert counts of a synthetic RL workload (see the module doc for the model).

    Args:
        preset: a name of :data:`PRESETS` or a :class:`WorkloadPreset`.
        num_experts, num_layers, top_k: the model shape ``E``, ``L``, ``k``.
        num_batches, samples_per_batch: ``B`` batches (RL steps) of this many samples each.
        seed: everything is a function of it.
        max_tokens: truncate responses at this length (default: each domain's own maximum).
    Returns:
        :class:`SampleCounts` with counts int32 [B * samples_per_batch, L, E]; memory is one batch's
        ``[S_b, L, E]`` float64 routing distributions plus the int32 output.
    """
    spec = get_preset(preset)
    _check_shape(num_experts, num_layers, top_k, num_batches, samples_per_batch)
    total = num_batches * samples_per_batch
    counts = np.empty((total, num_layers, num_experts), dtype=np.int32)
    tokens = np.empty(total, dtype=np.int64)
    domain = np.empty(total, dtype=np.int16)
    for b, (rng, dom, lengths, probs) in enumerate(
        _batches(spec, num_experts, num_layers, num_batches, samples_per_batch, seed, max_tokens)
    ):
        sl = slice(b * samples_per_batch, (b + 1) * samples_per_batch)
        counts[sl] = counts_from_probs(probs, lengths, top_k, rng)
        tokens[sl], domain[sl] = lengths, dom
    return SampleCounts(
        counts=counts,
        tokens=tokens,
        batch_offsets=np.arange(0, total + 1, samples_per_batch, dtype=np.int64),
        top_k=top_k,
        sample_domain=domain,
        domain_names=tuple(d.name for d in spec.domains),
        meta=_meta(spec, num_experts, num_layers, top_k, seed, max_tokens),
    )


def _meta(
    spec: WorkloadPreset, num_experts: int, num_layers: int, top_k: int, seed: int, max_tokens: int | None
) -> dict[str, object]:
    return {
        "num_experts": num_experts,
        "top_k": top_k,
        "num_layers": num_layers,
        "model": "synthetic",
        "source": f"synthetic:{spec.name}",
        "preset": spec.name,
        "seed": seed,
        "max_tokens": max_tokens,
    }


def generate_trace(
    preset: str | WorkloadPreset,
    num_experts: int,
    num_layers: int,
    top_k: int,
    num_batches: int,
    samples_per_batch: int,
    seed: int,
    max_tokens: int | None = None,
    max_total_tokens: int = 2_000_000,
) -> RoutingTrace:
    """Per-token routes of a synthetic workload (small cases; same model and lengths as the counts).

    Every token draws ``k`` distinct experts exactly, by Gumbel top-k over its sample's routing
    distribution. Memory is ``O(T_s L E)`` per sample; refuses more than ``max_total_tokens`` tokens.
    """
    spec = get_preset(preset)
    _check_shape(num_experts, num_layers, top_k, num_batches, samples_per_batch)
    if num_experts > np.iinfo(np.int16).max:
        raise ValueError(f"num_experts={num_experts} does not fit the trace's int16 expert ids")
    routes: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    domains: list[np.ndarray] = []
    for rng, dom, lens, probs in _batches(
        spec, num_experts, num_layers, num_batches, samples_per_batch, seed, max_tokens
    ):
        if sum(int(x.sum()) for x in lengths) + int(lens.sum()) > max_total_tokens:
            raise ValueError(
                f"the trace would exceed max_total_tokens={max_total_tokens}; "
                "use generate_counts for large cases"
            )
        logp = numerics.log(np.maximum(probs, 1e-300))
        for s in range(lens.shape[0]):
            gumbel = rng.gumbel(size=(int(lens[s]), num_layers, num_experts))
            keys = logp[s][None] + gumbel
            routes.append(np.argpartition(-keys, top_k - 1, axis=-1)[..., :top_k].astype(np.int16))
        lengths.append(lens)
        domains.append(dom)
    all_lengths = np.concatenate(lengths)
    return RoutingTrace(
        experts=np.concatenate(routes),
        sample_offsets=np.r_[0, np.cumsum(all_lengths)].astype(np.int64),
        batch_offsets=np.arange(0, num_batches * samples_per_batch + 1, samples_per_batch, dtype=np.int64),
        sample_domain=np.concatenate(domains),
        domain_names=tuple(d.name for d in spec.domains),
        meta=_meta(spec, num_experts, num_layers, top_k, seed, max_tokens),
    )

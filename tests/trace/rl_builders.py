"""The in-memory structures RL trainers hold their recorded routes in, built from per-sample routes.

Each builder follows the layout its framework's source documents (the file named in its docstring) so
that the importers of :mod:`relibra.trace.importers_rl` are tested against the same layout; where verl is
installed, ``tests/trace/test_importers_rl.py`` builds verl's batch with verl's own classes too.
"""

from __future__ import annotations

import numpy as np

from relibra.trace.importers_rl import fill_route


def sample_routes(
    rng: np.random.Generator, lengths: list[int], layers: int, experts: int, k: int
) -> list[np.ndarray]:
    """Distinct top-k ids per (token, layer): int64 [T_s, L, k] per sample."""
    return [np.argsort(rng.random((t, layers, experts)), axis=-1)[..., :k] for t in lengths]


def verl_batch(
    recorded: list[np.ndarray], prompt_lens: list[int], max_prompt: int, max_response: int
) -> tuple[np.ndarray, np.ndarray]:
    """verl's ``routed_experts`` [bs, P + R, L, k] (zeros) and ``attention_mask`` [bs, P + R].

    ``verl/experimental/agent_loop/agent_loop.py``: the prompt is left-padded to ``P``, the response
    right-padded to ``R``; the rollout's ``[len, L, k]`` starts at the first real prompt position.
    ``recorded[s]`` holds ``prompt + response - 1`` rows (every token but the last).
    """
    bs, (num_layers, k) = len(recorded), recorded[0].shape[1:]
    routed = np.zeros((bs, max_prompt + max_response, num_layers, k), dtype=np.int64)
    mask = np.zeros((bs, max_prompt + max_response), dtype=np.int64)
    for s, (rows, p) in enumerate(zip(recorded, prompt_lens, strict=True)):
        start = max_prompt - p
        routed[s, start : start + rows.shape[0]] = rows
        mask[s, start : start + rows.shape[0] + 1] = 1
    return routed, mask


def areal_batch(recorded: list[np.ndarray], seq: int) -> tuple[np.ndarray, np.ndarray]:
    """AReaL's left-padded ``routed_experts`` (bs, seq, num_moe_layers, topk), zeros, and its mask
    (``areal/engine/megatron_engine_r3_patch.py``); the last real token is unrecorded."""
    bs, (num_layers, k) = len(recorded), recorded[0].shape[1:]
    routed = np.zeros((bs, seq, num_layers, k), dtype=np.int32)
    mask = np.zeros((bs, seq), dtype=bool)
    for s, rows in enumerate(recorded):
        start = seq - rows.shape[0] - 1
        routed[s, start : seq - 1] = rows
        mask[s, start:] = True
    return routed, mask


def nemo_batch(
    recorded: list[np.ndarray], seq: int, missing: dict[int, list[int]] | None = None, dtype: type = np.int16
) -> tuple[np.ndarray, np.ndarray]:
    """NeMo-RL's right-padded ``routed_experts`` [B, S, L, k] and ``input_lengths`` [B]
    (``nemo_rl/models/generation/vllm/utils.py``: filler ``0..k-1`` in padding and the last token, the
    all ``-1`` sentinel where vLLM returned no route; ``missing[s]`` lists such rows of sample ``s``)."""
    bs, (num_layers, k) = len(recorded), recorded[0].shape[1:]
    routed = np.empty((bs, seq, num_layers, k), dtype=dtype)
    routed[...] = fill_route(num_layers, k)
    lengths = np.array([r.shape[0] + 1 for r in recorded], dtype=np.int64)
    for s, rows in enumerate(recorded):
        routed[s, : rows.shape[0]] = rows
        for t in (missing or {}).get(s, []):
            routed[s, t] = -1
    return routed, lengths


def skyrl_padded(recorded: list[np.ndarray], seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SkyRL's left-padded training tensor (``skyrl/train/dataset/preprocess.py``), its attention mask and
    the per-sample route counts: filler ``0..k-1`` in padding and after each sample's routes."""
    bs, (num_layers, k) = len(recorded), recorded[0].shape[1:]
    padded = np.empty((bs, seq, num_layers, k), dtype=np.uint8)
    padded[...] = fill_route(num_layers, k)
    mask = np.zeros((bs, seq), dtype=np.int64)
    for s, rows in enumerate(recorded):
        left = seq - rows.shape[0] - 1
        padded[s, left : left + rows.shape[0]] = rows
        mask[s, left:] = 1
    return padded, mask, np.array([r.shape[0] for r in recorded], dtype=np.int64)

"""Measure one GPU's expert GEMM time and device-to-device copy bandwidth for the cost model.

For each model of ``experiments/conf/model`` (its ``hidden`` and ``moe_ffn``), time a grouped expert GEMM
(``--group`` experts of ``t`` tokens each, as one batched matmul per projection: gate, up, down, with SiLU)
forward and backward in bf16, for ``t`` over ``--tokens``; report seconds per expert. Then time a
device-to-device copy of replica-buffer-sized payloads (the replica refill; GPU 0 -> GPU 1 when two GPUs
are visible, else a copy within GPU 0's memory). Writes a JSON file that ``relibra/cost/model.py`` can read
instead of its roofline (format in docs/executor.md)::

    {"provenance": {"gpu": ..., "driver": ..., "torch": ..., "cuda": ..., "date": ..., ...},
     "models": {"qwen3-30b-a3b": {"hidden": 2048, "moe_ffn": 768, "tokens": [...],
                                  "fwd_s": [...], "bwd_s": [...], "seconds": [...]}},
     "d2d_bytes_per_s": 1.2e12, "d2d_kind": "peer" | "same-device"}

``--dry-run`` runs the same code on CPU with tiny shapes and float32 in a few seconds (tested in CI).
A full GPU run takes about a minute on a Hopper GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

CONF = Path(__file__).resolve().parents[1] / "experiments" / "conf" / "model"
GPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def model_shapes(conf_dir: Path = CONF) -> dict[str, tuple[int, int]]:
    """name -> (hidden, moe_ffn) of every model config."""
    out = {}
    for path in sorted(conf_dir.glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        out[str(cfg["name"])] = (int(cfg["hidden"]), int(cfg["moe_ffn"]))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def grouped_expert_times(
    hidden: int, ffn: int, tokens: int, group: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> tuple[float, float]:
    """(forward, backward) seconds per expert of a grouped GEMM: ``group`` experts x ``tokens`` tokens."""
    x = torch.randn(group, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    gate = torch.randn(group, hidden, ffn, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(group, hidden, ffn, device=device, dtype=dtype, requires_grad=True)
    down = torch.randn(group, ffn, hidden, device=device, dtype=dtype, requires_grad=True)
    gy = torch.randn(group, tokens, hidden, device=device, dtype=dtype)

    def fwd() -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(x, gate)) * torch.bmm(x, up), down)

    def fwd_no_grad() -> None:
        with torch.no_grad():
            fwd()

    def fwd_bwd() -> None:
        torch.autograd.backward(fwd(), gy, inputs=[x, gate, up, down])

    t_fwd = _time(fwd_no_grad, device, repeats)
    t_both = _time(fwd_bwd, device, repeats)
    return t_fwd / group, max(t_both - t_fwd, 0.0) / group


def d2d_bandwidth(nbytes: int, repeats: int, device: torch.device) -> tuple[float, str]:
    """Bytes per second of a device-to-device copy of ``nbytes`` (peer copy when two GPUs are visible)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    kind = "same-device"
    dst_device = device
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        dst_device, kind = torch.device("cuda", 1), "peer"
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        _sync(dst_device)

    return nbytes / _time(copy, device, repeats), kind


def provenance(device: torch.device, dry_run: bool, dtype: torch.dtype) -> dict[str, object]:
    info: dict[str, object] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "host": platform.node(),
        "dtype": str(dtype).removeprefix("torch."),
        "dry_run": dry_run,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    else:
        info.update(gpu=f"cpu ({platform.processor() or platform.machine()})", cuda=None, driver=None)
    return info


def calibrate(
    dry_run: bool, tokens: tuple[int, ...], group: int, repeats: int, copy_mib: int, models: list[str] | None
) -> dict[str, object]:
    device = torch.device("cpu" if dry_run or not torch.cuda.is_available() else "cuda", 0)
    if not dry_run and device.type != "cuda":
        raise SystemExit("no CUDA GPU is visible; run with --dry-run to exercise the script on CPU")
    dtype = torch.float32 if dry_run else torch.bfloat16
    shapes = model_shapes()
    if models:
        unknown = sorted(set(models) - set(shapes))
        if unknown:
            raise SystemExit(f"--models {unknown} not in {sorted(shapes)}")
        shapes = {m: shapes[m] for m in models}
    out_models = {}
    for name, (hidden, ffn) in shapes.items():
        if dry_run:  # NOTE: tiny stand-in shapes keep the CPU run to seconds; the table is not a measurement.
            hidden, ffn = max(hidden // 128, 8), max(ffn // 128, 4)
        fwd, bwd = zip(*(grouped_expert_times(hidden, ffn, t, group, device, dtype, repeats) for t in tokens))
        out_models[name] = {
            "hidden": hidden,
            "moe_ffn": ffn,
            "tokens": list(tokens),
            "fwd_s": list(fwd),
            "bwd_s": list(bwd),
            "seconds": [a + b for a, b in zip(fwd, bwd)],  # fwd + bwd: what relibra.cost.model reads
        }
    bw, kind = d2d_bandwidth(copy_mib << 20, repeats, device)
    return {
        "provenance": {**provenance(device, dry_run, dtype), "group": group, "repeats": repeats},
        "models": out_models,
        "d2d_bytes_per_s": bw,
        "d2d_kind": kind,
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("calibration_gpu.json"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32 (seconds)")
    p.add_argument("--tokens", type=int, nargs="*", help="tokens per expert to measure")
    p.add_argument("--group", type=int, default=8, help="experts per grouped GEMM")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--copy-mib", type=int, default=None, help="payload of the d2d copy, MiB")
    p.add_argument("--models", nargs="*", help="model names (default: every experiments/conf/model)")
    a = p.parse_args(argv)
    tokens = tuple(a.tokens) if a.tokens else ((1, 4, 16, 64) if a.dry_run else GPU_TOKENS)
    result = calibrate(
        a.dry_run,
        tokens,
        a.group if not a.dry_run else min(a.group, 2),
        a.repeats or (2 if a.dry_run else 10),
        a.copy_mib or (1 if a.dry_run else 256),
        a.models,
    )
    a.out.write_text(json.dumps(result, indent=2))
    models, bw = result["models"], result["d2d_bytes_per_s"]
    assert isinstance(models, dict) and isinstance(bw, float)
    print(f"wrote {a.out}: {len(models)} models, d2d {bw / 1e9:.1f} GB/s")
    return result


if __name__ == "__main__":
    main()

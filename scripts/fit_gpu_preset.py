#!/usr/bin/env python
"""Fit one GPU's kernel-efficiency curve and overlap slowdown from scripts/gpu_check.py's block-time sweep.

    python scripts/fit_gpu_preset.py RESULTS.json [--name h200-ib400] [--write]

The sweep times the block kernel (bf16, 32/8 heads, d 128, keys = rows) alone and while a side
stream keeps HBM busy with 256 MiB copies. Per direction the throughput is fitted as
``peak * rows / (rows + half)`` (least squares on 1/throughput against 1/rows, non-causal rows);
the slowdown is the median of (time under copies / time alone - 1) over rows >= 1024. With
``--write`` the preset ``megatron_mesh_cp/configs/clusters/NAME.yaml`` gets the fitted attention
figures and ``slowdown_intra``, the rest taken from the device's datasheet (see the preset's notes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np


def sweep_rows(results: dict):
    for section in results.get("results", {}).values():
        for r in section.get("data", []):
            if isinstance(r, dict) and {"rows", "dir", "ms", "tflops"} <= r.keys():
                yield r


def fit(rows):
    """direction -> (peak TFLOP/s, half-efficiency rows, slowdown) from the non-causal sweep."""
    out = {}
    for direction in ("fwd", "bwd"):
        pts = [r for r in rows if r["dir"] == direction and not r.get("causal") and r["tflops"]]
        if len(pts) < 3:
            raise SystemExit(f"too few {direction} sweep rows in the results ({len(pts)})")
        x = np.array([1.0 / r["rows"] for r in pts])
        y = np.array([1.0 / r["tflops"] for r in pts])
        slope, icpt = np.polyfit(x, y, 1)
        peak = 1.0 / icpt
        slow = [r["slowdown"] - 1.0 for r in pts if r.get("slowdown") and r["rows"] >= 1024]
        out[direction] = (peak, max(0.0, slope * peak), statistics.median(slow) if slow else None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--name", default="h200-ib400")
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    data = json.loads(Path(args.results).read_text())
    device = data.get("env", {}).get("device", "unknown GPU")
    rows = list(sweep_rows(data))
    f = fit(rows)
    for d, (peak, half, slow) in f.items():
        print(f"{d}: peak {peak:.0f} TFLOP/s, half efficiency at {half:.0f} rows, slowdown under copies "
              f"{'n/a' if slow is None else f'{slow:.1%}'}")
    for r in rows:
        print(f"  {r['dir']} rows {r['rows']:>6} causal {bool(r.get('causal'))!s:5} {r['ms']:.3f} ms "
              f"{r['tflops']:.0f} TFLOP/s" + (f"  x{r['slowdown']:.2f} under copies" if r.get("slowdown") else ""))
    if args.write:
        slows = [s for _, _, s in f.values() if s is not None]
        path = Path(__file__).resolve().parent.parent / "megatron_mesh_cp" / "configs" / "clusters" / f"{args.name}.yaml"
        path.write_text(PRESET.format(
            name=args.name, device=device, fwd=f["fwd"][0], bwd=f["bwd"][0],
            half=round((f["fwd"][1] + f["bwd"][1]) / 2), slow=round(statistics.mean(slows), 3) if slows else 0.3))
        print(f"written {path}")
    return 0


PRESET = """# 8x H200 SXM per node (NVLink 4 + NVSwitch), one 400 Gb/s InfiniBand NIC per GPU.
# MEASURED on one {device} (scripts/gpu_check.py block-time sweep, torch's CUDA SDPA flash kernel,
# bf16, 32/8 heads, d 128; fitted by scripts/fit_gpu_preset.py): the attention throughputs, the
# half-efficiency block size and slowdown_intra (compute slowdown while a side stream saturates HBM
# with copies: an upper bound for NCCL's interference). NOT measured: the links (datasheet NVLink
# 450 GB/s and 400 Gb/s IB per GPU, at ~80% achievable) and the other overlap costs (the
# calibrated values, docs/calibration.md).
name: {name}
description: 8xH200 SXM nodes, kernel figures measured on one {device}, links from the datasheet
gpus_per_node: 8
intra_node: {{bandwidth_GBps: 360, latency_us: 4}}
inter_node: {{bandwidth_GBps: 45, latency_us: 12}}
hbm_GBps: 4300
attention:
  forward_tflops: {fwd:.0f}
  backward_tflops: {bwd:.0f}
  half_efficiency_tokens: {half}
bytes_per_element: 2
overlap: {{slowdown_intra: {slow}, slowdown_inter: 0.025, block_overhead_us: 40.0, correction_passes: 6.0}}
"""


if __name__ == "__main__":
    sys.exit(main())

"""The CPU-testable parts of the GPU path: buffer reuse, the GPU check script (smoke) and the
attention benchmark on gloo (the SLURM jobs: test_slurm_jobs.py)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_mesh_cp import MeshShape
from megatron_mesh_cp.runtime.comm import VirtualHub
from megatron_mesh_cp.virtual import virtual_mesh_attention

ROOT = Path(__file__).resolve().parent.parent


def test_buffers_are_allocated_once_per_layer_shape_and_never_alias_results():
    from megatron_mesh_cp.call import plan, resolve
    from megatron_mesh_cp.virtual import VirtualMesh
    from megatron_mesh_cp.runtime.execute import run_virtual
    from megatron_mesh_cp.runtime.kernels import TorchKernel
    from megatron_mesh_cp.runtime.layout import zigzag_shard

    shape = MeshShape(2, 2)
    hub = VirtualHub(shape)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 2, h, 8, generator=g) for h in (4, 2, 2))
    per = [dict(q=zigzag_shard(q, 4, r, 0), k=zigzag_shard(k, 4, r, 0), v=zigzag_shard(v, 4, r, 0)) for r in range(4)]
    fwd, _ = plan(resolve(per[0]["q"], per[0]["k"], per[0]["v"], VirtualMesh((2, 2)), layout="sbhd"))[0]
    first, _ = run_virtual(fwd, shape, per, TorchKernel(), causal=True, scale=0.3, hub=hub)
    sizes = [len(c.buffers) for c in hub.ranks]
    nbytes = [c.buffers.nbytes() for c in hub.ranks]
    second, _ = run_virtual(fwd, shape, per, TorchKernel(), causal=True, scale=0.3, hub=hub)  # "the next layer"
    assert [len(c.buffers) for c in hub.ranks] == sizes == [1] * 4 and [c.buffers.nbytes() for c in hub.ranks] == nbytes
    arenas = [(a.buf.data_ptr(), a.buf.data_ptr() + a.nbytes) for c in hub.ranks for a in c.buffers._arenas.values()]
    for (o1, l1), (o2, l2) in zip(first, second):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)  # the first results were not overwritten
        for t in (o1, l1):
            assert not any(lo <= t.data_ptr() < hi for lo, hi in arenas)


def test_gpu_check_script_smoke_on_cpu(tmp_path):
    """The GPU check end to end on CPU (``--device cpu --quick``, what CI runs): every section runs in
    its own process and reports rows, and both the markdown and the JSON of raw numbers land in the
    output directory. The executor sections ((e)-(g)) pass on CPU: the stream stand-in (copies
    deferred to the first wait) is bitwise equal to the same-stream run on slab plans for 2x2, 4x4
    and 8x2; warm a2a+mesh calls are bitwise equal with every pool at peak_live_bytes; the n = 16
    run reports its host cost per kernel call; (h) runs the torch kernel over calls of changing shapes
    and mesh attention over batches of new documents; (i) times D documents in one varlen call
    against D calls beside the simulator's price of both."""
    import json

    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "", "--device", "cpu", "--quick"],
                         capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    text = (tmp_path / "gpu_results.md").read_text()
    for section in ("(a) Block kernels", "(b) Mesh attention on virtual ranks", "(d) Block-time sweep", "(c) One rank's block work",
                    "(e) NCCL-like streams", "(f) Warm-call hygiene", "(g) n = 16 at 64K tokens",
                    "(h) Calls of changing shapes", "(i) What one more kernel call costs"):
        assert section in text
    assert "FAIL" not in text and "ERROR" not in text
    kernels = text.split("## (b)")[0]
    assert kernels.count("| torch | float32 |") == 4 and kernels.count("| torch | bfloat16 |") == 4
    assert "te: not installed; flash: not installed; torch: available" in text
    raw = json.loads((tmp_path / "gpu_results.json").read_text())["results"]
    assert [r["n"] for r in raw["b"]["data"]] == [4, 16] and len(raw["c"]["data"]) == 2
    sweep = raw["d"]["data"][1:]
    assert len(sweep) == 8 and all(r["ms"] > 0 and r["ms_copies"] is None for r in sweep)  # no copy stream on CPU
    calls = raw["i"]["data"]
    assert [r["docs"] for r in calls] == [1, 4, 8] and all(r["one_ms"] > 0 and r["many_ms"] > 0 for r in calls)
    assert all(r["model_many_ms"] > r["model_one_ms"] for r in calls[1:])  # the model charges every call its fixed costs
    streams = raw["e"]["data"]
    assert [r["shape"] for r in streams] == ["2x2", "4x4", "8x2"] and all(r["result"] == "ok" for r in streams)
    assert all(r["slabs"] != "()" and r["deliveries"] > 0 and "deferred" in r["transport"] for r in streams)
    (warm,) = raw["f"]["data"]
    assert warm["result"] == "ok" and warm["bitwise"] and warm["pool_bytes"] == [warm["peak_live_bytes"]]
    assert warm["host_syncs"] is None and "CPU: no sync debug mode" in warm["notes"]
    (host,) = raw["g"]["data"]
    assert host["n"] == 16 and host["kernel_calls"] > 0 and host["host_us_per_call"] > 0 and host["mono_ms"] > 0
    shapes, docs = raw["h"]["data"]  # CPU: the torch kernel's shapes, then documents over changing batches
    assert shapes["backend"] == "torch" and shapes["calls"] == 24 and shapes["memory_growth_mib"] is None
    assert docs["part"] == "documents" and docs["calls"] == 4 and all(r["result"] == "ok" for r in (shapes, docs))


def test_attention_benchmark_on_gloo(tmp_path):
    out_csv, out_png, out_md = tmp_path / "b.csv", tmp_path / "b.png", tmp_path / "b.md"
    from megatron_runs import launch  # 4 ranks forked as torchrun would start them

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    argv = ["--seq", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--shapes", "auto,2x2,1x4,2x1x2",
            "--iters", "2", "--warmup", "1", "--repeats", "3", "--csv", str(out_csv), "--plot", str(out_png),
            "--markdown", str(out_md)]
    rc, stdout, stderr = launch(tmp_path, "bench", 4, argv, timeout=300, script=ROOT / "scripts" / "bench_attention.py",
                                environ=env)
    res = SimpleNamespace(returncode=rc, stdout=stdout, stderr=stderr)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader(out_csv.open()))
    names = [r["algorithm"] for r in rows]
    assert names[1:3] == ["mesh 2x2", "mesh 1x4"] and names[0].startswith("mesh auto (")
    assert names[3].startswith("a2a+mesh auto (") and names[4] == "a2a+mesh 2x1x2"  # UxAxB runs Ulysses x mesh
    assert all(f"| {name} |" in out_md.read_text() for name in names) and "Measured:" in out_md.read_text()
    assert all(float(r["ms"]) > 0 and int(r["bytes_per_rank"]) > 0 and r["bytes_source"] == "measured" for r in rows)
    assert all(0 < float(r["ms_min"]) <= float(r["ms"]) <= float(r["ms_max"]) and r["repeats"] == "3" for r in rows)
    assert "median ms" in res.stdout and "min-max ms" in res.stdout
    assert "skip p2p: needs Transformer Engine on CUDA" in res.stdout
    assert out_png.stat().st_size > 10_000


def test_attention_benchmark_generates_only_this_ranks_share():
    """Each rank draws its two zigzag pieces itself: the shares form one sequence, none is ever built whole."""
    import importlib.util
    from types import SimpleNamespace

    from megatron_mesh_cp.runtime.layout import zigzag_shard

    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "scripts" / "bench_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = SimpleNamespace(seq=64, batch=1, heads=4, kv_heads=2, head_dim=8)
    cpu = torch.device("cpu")
    shares = [bench._inputs(args, 4, r, cpu, torch.float32) for r in range(4)]
    pieces = [None] * 8  # rebuild the global sequence from the shares, then shard it the usual way
    for r, (q, *_rest) in enumerate(shares):
        pieces[r], pieces[7 - r] = q.detach().chunk(2)
    full_q = torch.cat(pieces)
    for r in range(4):
        assert torch.equal(zigzag_shard(full_q, 4, r, dim=0), shares[r][0].detach())
    assert shares[1][0].shape == (16, 1, 4, 8) and shares[1][1].shape == (16, 1, 2, 8)
    # 2^34 tokens (64 GiB per fp32 tensor if built whole), 2^24 ranks: only 2 x 512 tokens are drawn
    huge = SimpleNamespace(seq=2**34, batch=1, heads=1, kv_heads=1, head_dim=1)
    q, k, v, do = bench._inputs(huge, 2**24, 5, cpu, torch.float32)
    assert q.shape == (1024, 1, 1, 1) and q.requires_grad and not do.requires_grad


def test_flash_gradient_buffers_stay_bounded_over_batches_of_changing_documents(monkeypatch):
    """The flash kernel writes dq/dk/dv into buffers it keeps per block shape. With documents the
    sub-blocks' shapes change every batch (and differ per rank): 12 batches of new documents give
    far more than ``GRAD_SHAPES`` distinct backward shapes, and the kernel keeps at most that many
    (a cache that never evicts grows until a rank runs out of GPU memory); results stay exact."""
    import fake_kernels
    from megatron_mesh_cp.reference import relative_errors, variant_reference
    from megatron_mesh_cp.runtime import kernels as K
    from megatron_mesh_cp.runtime.kernels import flash

    monkeypatch.setattr(K, "_INSTANCES", {})
    fake_kernels.pretend_cuda(monkeypatch, te=None, flash="2.8")
    kern = K.get_kernel("flash", "cuda")
    monkeypatch.setattr(type(kern), "check", lambda self, q, k, v=None: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(type(kern), "check_varlen", lambda self, q, k=None, v=None: None)
    seen, backward = set(), kern.backward

    def counting(dout, q, k, v, *args, **kw):
        seen.add((tuple(q.shape), tuple(k.shape)))
        return backward(dout, q, k, v, *args, **kw)

    monkeypatch.setattr(kern, "backward", counting)
    g = torch.Generator().manual_seed(0)
    t = 128
    for batch in range(12):
        inner = sorted(torch.randperm(t - 1, generator=g)[:3].add(1).tolist())
        cu = [0] + inner + [t]
        q, k, v, do = (torch.randn(t, x, 16, generator=g, dtype=torch.float64) for x in (4, 2, 2, 4))
        res = virtual_mesh_attention(*(x.half()[None] for x in (q, k, v)), (1, 4), dout=do.half()[None], causal=True,
                                     cu_seqlens=torch.tensor(cu, dtype=torch.int32), kernel=kern)
        assert len(kern._grads) <= flash.GRAD_SHAPES, (batch, len(kern._grads))
        if batch == 0:
            ref = variant_reference(q, k, v, do, cu, causal=True)
            got = {name: res[name][0] for name in ("out", "lse", "dq", "dk", "dv")}
            ref.pop("max_logit")
            assert all(err < 5e-3 for err in relative_errors(got, ref).values())
    assert len(seen) > 2 * flash.GRAD_SHAPES, len(seen)  # the bound is what kept the cache small

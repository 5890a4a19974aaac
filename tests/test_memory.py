"""Memory that follows the plan and a bounded pool: the bytes a rank's
buffer pool holds for one layer shape equal the plan's peak live bytes, per phase."""

from __future__ import annotations

import pytest
import torch

from megatron_mesh_cp import MeshShape
from megatron_mesh_cp.call import plan, resolve
from megatron_mesh_cp.runtime.comm import VirtualHub
from megatron_mesh_cp.runtime.buffers import BufferPool
from megatron_mesh_cp.runtime.execute import run_virtual
from megatron_mesh_cp.runtime.kernels import TorchKernel
from megatron_mesh_cp.runtime.layout import zigzag_shard
from megatron_mesh_cp.runtime.memory import buffer_lives, layout, peak_live_bytes
from megatron_mesh_cp.runtime.plan import ChunkDims
from megatron_mesh_cp.virtual import VirtualMesh


def _case(a, b, causal, h, hk, s_local=8, d=8, batch=1, seed=0):
    shape = MeshShape(a, b)
    n = shape.n
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(s_local * n, batch, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(s_local * n, batch, hk, d, generator=g) for _ in range(2))
    sh = lambda x, r: zigzag_shard(x, n, r, 0)  # noqa: E731
    plans = plan(resolve(sh(q, 0), sh(k, 0), sh(v, 0), VirtualMesh((a, b)), causal=causal, layout="sbhd"))[0]
    fwd_in = [dict(q=sh(q, r), k=sh(k, r), v=sh(v, r)) for r in range(n)]
    dims = ChunkDims.of(fwd_in[0]["q"], fwd_in[0]["k"], torch.float32)
    return shape, plans, fwd_in, lambda res: [
        dict(fwd_in[r], out=res[r][0], lse=res[r][1], dout=sh(do, r), delta=(sh(do, r) * res[r][0]).sum(-1))
        for r in range(n)], dims


SHAPES = [(1, 16, True, 8, 2), (8, 2, True, 8, 2), (4, 4, True, 8, 2), (4, 4, False, 8, 8), (16, 1, False, 8, 2),
          (2, 2, True, 4, 1)]


@pytest.mark.parametrize("a,b,causal,h,hk", SHAPES)
def test_pool_bytes_equal_the_plans_peak_live_bytes_per_phase(a, b, causal, h, hk):
    shape, (fwd, bwd), fwd_in, bwd_in, dims = _case(a, b, causal, h, hk)
    kern = TorchKernel()
    peak_f, peak_b = peak_live_bytes(fwd, dims), peak_live_bytes(bwd, dims)
    hub = VirtualHub(shape)  # forward only
    res, _ = run_virtual(fwd, shape, fwd_in, kern, causal=causal, scale=0.3, hub=hub)
    assert [c.buffers.nbytes() for c in hub.ranks] == [peak_f] * shape.n
    hub_b = VirtualHub(shape)  # backward only
    run_virtual(bwd, shape, bwd_in(res), kern, causal=causal, scale=0.3, hub=hub_b)
    assert [c.buffers.nbytes() for c in hub_b.ranks] == [peak_b] * shape.n
    run_virtual(bwd, shape, bwd_in(res), kern, causal=causal, scale=0.3, hub=hub)  # both: one arena, the larger
    assert [c.buffers.nbytes() for c in hub.ranks] == [max(peak_f, peak_b)] * shape.n
    for plan in (fwd, bwd):  # bytes are reused: less than one buffer per chunk ever received
        lives = buffer_lives(plan, dims)
        assert layout(plan, dims).nbytes == peak_live_bytes(plan, dims) <= sum(x.nbytes for x in lives)
        if max(x.start for x in lives) > min(x.end for x in lives):  # some tensor dies before another is born
            assert peak_live_bytes(plan, dims) < sum(x.nbytes for x in lives)


def test_reused_bytes_keep_results_exact_and_bitwise_repeatable():
    shape, (fwd, bwd), fwd_in, bwd_in, _ = _case(4, 4, True, 8, 2)
    kern = TorchKernel()
    hub = VirtualHub(shape)
    first, _ = run_virtual(fwd, shape, fwd_in, kern, causal=True, scale=0.3, hub=hub)
    g1, _ = run_virtual(bwd, shape, bwd_in(first), kern, causal=True, scale=0.3, hub=hub)
    # a fresh pool (no reuse across runs) and the warm one give the same bits
    fresh, _ = run_virtual(fwd, shape, fwd_in, kern, causal=True, scale=0.3)
    g2, _ = run_virtual(bwd, shape, bwd_in(fresh), kern, causal=True, scale=0.3, hub=hub)
    assert all(torch.equal(x, y) for r1, r2 in zip(first, fresh) for x, y in zip(r1, r2))
    assert all(torch.equal(x, y) for r1, r2 in zip(g1, g2) for x, y in zip(r1, r2))


def test_pool_keeps_the_most_recent_layer_shapes_and_a_byte_cap():
    kern = TorchKernel()
    pool = BufferPool(max_shapes=2)
    sizes = []
    for s_local in (4, 6, 8):
        shape, (fwd, _), fwd_in, _, dims = _case(2, 2, True, 4, 2, s_local=s_local)
        hub = VirtualHub(shape)
        for c in hub.ranks:
            c.buffers = pool if c.position == 0 else BufferPool()
        run_virtual(fwd, shape, fwd_in, kern, causal=True, scale=0.3, hub=hub)
        sizes.append(peak_live_bytes(fwd, dims))
    assert len(pool) == 2 and pool.nbytes() == sizes[1] + sizes[2]  # the 4-token shape was evicted
    capped = BufferPool(max_bytes=sizes[2])
    for s_local in (4, 8):
        shape, (fwd, _), fwd_in, _, _ = _case(2, 2, True, 4, 2, s_local=s_local)
        hub = VirtualHub(shape)
        hub.ranks[0].buffers = capped
        run_virtual(fwd, shape, fwd_in, kern, causal=True, scale=0.3, hub=hub)
    assert len(capped) == 1 and capped.nbytes() == sizes[2]
    with pytest.raises(ValueError, match="max_shapes"):
        BufferPool(max_shapes=0)


# --- the dry run's attention figure: each algorithm's real buffers, the planner's figure -----

_DRY_RUN_MEMORY = r"""
import json, logging, os, sys
from megatron_mesh_cp.megatron import cpu_compat
cpu_compat.activate()
from megatron_mesh_cp.megatron.cp_layer import attention_peak_bytes, attention_workload, simulator_name
from megatron_mesh_cp.megatron.memory import report
from megatron_mesh_cp.megatron.pretrain import parse_megatron_args
from megatron_mesh_cp.megatron.settings import options
from megatron_mesh_cp.planning.baselines import simulate_algorithm
from megatron_mesh_cp.planning.schedule import default_cluster

logged = []
class Grab(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger("megatron_mesh_cp").addHandler(Grab())
logging.getLogger("megatron_mesh_cp").setLevel(logging.INFO)
base = ["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
        "--num-query-groups", "8", "--micro-batch-size", "1", "--bf16", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--attention-dropout", "0"]
out = []
for flags in json.loads(sys.argv[1]):
    logged.clear()
    args = parse_megatron_args(base + flags, set_globals=False)
    sim = simulator_name(args)
    want = simulate_algorithm(sim, args.context_parallel_size, options().cluster or default_cluster(),
                              attention_workload(args), max_live=options().max_live).peak_bytes
    auto = [m for m in logged if "mesh_shape=auto" in m and "peak attention memory" in m]
    out.append(dict(sim=sim, got=attention_peak_bytes(args), want=want, line=report(args, 80.0)[0][1],
                    auto_mib=float(auto[-1].split("peak attention memory ")[1].split(" MiB")[0]) if auto else None))
print("RESULT " + json.dumps(out))
"""


def test_dry_run_attention_memory_is_each_algorithms_own_figure(tmp_path):
    """The estimate's attention term is the simulator's per-rank peak for the algorithm that runs (Ring's and
    Ulysses x Ring's buffers for TE; the plans' arena + all-to-all tensors for mesh / a2a+mesh, never 0), and
    under ``mesh_shape: auto`` exactly the peak the planner logs: one figure, printed once."""
    import json
    import os

    from megatron_runs import run_script

    seq = ["--seq-length", "1048576", "--max-position-embeddings", "1048576"]
    cases = [
        ["--context-parallel-size", "256", "--context-parallel-algo", "p2p", *seq],
        ["--context-parallel-size", "256", "--context-parallel-algo", "a2a+p2p", "--hierarchical-context-parallel-sizes",
         "8", "32", *seq],
        ["--context-parallel-size", "64", "--context-parallel-algo", "mesh", "--mesh-shape", "4x16", *seq],
        ["--context-parallel-size", "256", "--context-parallel-algo", "a2a+mesh", "--mesh-shape", "8x2x16", *seq],
        ["--context-parallel-size", "32", "--context-parallel-algo", "a2a", *seq],
        ["--context-parallel-size", "64", "--context-parallel-algo", "a2a+mesh", "--mesh-shape", "auto",
         "--seq-length", "262144", "--max-position-embeddings", "262144"],
    ]
    env = dict(os.environ, WORLD_SIZE="256", RANK="0", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1")
    script = tmp_path / "dry_run_memory.py"
    script.write_text(_DRY_RUN_MEMORY)
    code, stdout, stderr = run_script(tmp_path, "dry_run_memory", script, [json.dumps(cases)], env, cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    rows = json.loads(stdout.split("RESULT ", 1)[1])
    assert [r["sim"] for r in rows[:5]] == ["ring", "usp:8", "mesh:4x16", "a2a+mesh:8x2x16", "ulysses"]
    for r in rows:
        assert r["got"] == r["want"] > 0, r
        assert f"attention {r['got'] / 2**30:.2f} (" in r["line"] and r["line"].count("attention") == 1, r["line"]
    assert rows[-1]["sim"].startswith("a2a+mesh:") and round(rows[-1]["got"] / 2**20) == rows[-1]["auto_mib"]


def test_the_dry_run_prints_the_parameter_count_in_a_unit_that_fits(monkeypatch):
    """The tiny CPU model's ~100K parameters are not "0.00 B": each count in its own unit (K, M, B)."""
    from megatron_mesh_cp.megatron import memory

    assert [memory.parameter_count(n) for n in (640, 103_488, 12_345_678, 999_999_999, 1_203_000_000)] == [
        "640", "103.5 K", "12.3 M", "1.00 B", "1.20 B"]
    parts = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "logits", "attention"), 0.0)
    monkeypatch.setattr(memory, "estimate", lambda args: {
        "parts": parts, "total": 0.0, "params": 103_488, "vocab_assumed": False, "recompute": False,
        "optimizer_shards": 1, "algorithm": "mesh"})
    line = memory.report(None, 80.0)[0][1]
    assert line.endswith("; 103.5 K parameters on this shard"), line

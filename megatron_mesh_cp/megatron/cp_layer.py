"""The attention layer a resolved Megatron configuration runs under CP: its per-rank workload, its CP
algorithm as the simulator names it, and the attention memory that algorithm holds per rank.

One mapping from Megatron's arguments (after :func:`.arguments.apply_mesh_args`) to the planning
layer's terms, shared by the dry run's memory estimate (:mod:`.memory`) and the step-time estimate
(``scripts/recipe_step_times.py``), so both price the layer that will run. The attention memory is
the figure the planner and the simulator report: for ``mesh`` / ``a2a+mesh`` the executor's arena
for the plans that will run (``runtime.memory`` peak live bytes, with the live-chunk limit
``mesh_shape: auto`` chose) plus the all-to-all's tensors; for TE's algorithms their buffers as
:mod:`megatron_mesh_cp.planning.costs` estimates them.
"""

from __future__ import annotations

from typing import List, Tuple

__all__ = ["cp_algorithm", "attention_workload", "simulator_name", "attention_peak_bytes"]


def cp_algorithm(args) -> Tuple[str, List[int]]:
    """(algorithm, sizes): ``mesh`` [a, b], ``a2a+mesh`` [u, a, b], ``a2a+p2p`` [u, rest], others []."""
    algo = getattr(args, "context_parallel_algo", None)
    comm = args.cp_comm_type
    if algo is None:
        algo = (comm[0] if isinstance(comm, (list, tuple)) and comm else comm) or "p2p"
    sizes = list(getattr(args, "hierarchical_context_parallel_sizes", None) or [])
    if algo in ("mesh", "a2a+mesh") and getattr(args, "mesh_shape", None):
        sizes = [int(x) for x in str(args.mesh_shape).split("x")]
    return algo, sizes


def attention_workload(args, packing=None):
    """One CP rank's attention inputs (after TP) as the planner's :class:`Workload`."""
    from ..planning import Workload
    from .variant_args import head_dims

    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    heads = args.num_attention_heads
    kv = args.num_query_groups if args.group_query_attention else heads
    half = bool(args.bf16 or args.fp16)
    qk, dv = head_dims(lambda name, default=None: getattr(args, name, default))  # MLA: its own q/k and v head dims
    return Workload(
        seq_local=args.seq_length // cp, heads=max(1, heads // tp), kv_heads=max(1, kv // tp),
        head_dim=qk, head_dim_v=dv, batch=args.micro_batch_size, causal=True,
        bytes_per_element=2 if half else 4,
        partial_bytes=2 if getattr(args, "mesh_partial_dtype", "fp32") == "bf16" else 4, mask=packing,
    )


def simulator_name(args) -> str:
    """The algorithm as ``megatron_mesh_cp.simulate`` names it (``ring``, ``usp:U``, ``mesh:AxB``, ...)."""
    algo, sizes = cp_algorithm(args)
    if algo == "mesh":
        return "mesh:" + "x".join(map(str, sizes))
    if algo == "a2a+mesh":
        return "a2a+mesh:" + "x".join(map(str, sizes))
    if algo == "a2a+p2p":
        if len(sizes) != 2:
            raise ValueError("a2a+p2p needs --hierarchical-context-parallel-sizes U R (Ulysses x Ring)")
        return f"usp:{sizes[0]}"
    return {"p2p": "ring", "a2a": "ulysses", "all_gather": "allgather"}[algo]


def attention_peak_bytes(args) -> int:
    """Attention memory per rank beyond q, k, v and the output, for the layer this config runs."""
    from ..planning import plan_peak_bytes, te_ring_peak_bytes, ulysses_buffer_bytes, ulysses_inner
    from ..planning import build_plans, default_cluster
    from .settings import options

    if args.context_parallel_size <= 1:
        return 0
    algo, sizes = cp_algorithm(args)
    w, tp = attention_workload(args), args.tensor_model_parallel_size
    cluster = options().cluster or default_cluster()
    if algo in ("mesh", "a2a+mesh"):
        u, (a, b) = (1, sizes) if algo == "mesh" else (sizes[0], sizes[1:])
        inner = ulysses_inner(u, w) if u > 1 else w
        pool = 0
        if a * b > 1 and options().documents == "eod" and options().planner == "greedy":
            # documents: the masked layer's plans, whichever batch (planned for its blocks' time)
            from ..planning import masked_pool_bytes

            pool = masked_pool_bytes(a, b, cluster, inner, stride=tp * u, max_live=options().max_live)
        elif a * b > 1:  # u = CP: one kernel call per phase, no mesh
            fwd, bwd = build_plans(a, b, options().planner, cluster=cluster, workload=inner, stride=tp * u,
                                   max_live=options().max_live)
            pool = plan_peak_bytes(fwd, bwd, inner)
        return pool + ulysses_buffer_bytes(u, w)
    if algo == "p2p":
        return te_ring_peak_bytes(w)
    if algo == "a2a+p2p":
        u, ring = sizes
        return (te_ring_peak_bytes(ulysses_inner(u, w)) if ring > 1 else 0) + ulysses_buffer_bytes(u, w)
    from ..planning import simulate_algorithm  # a2a, all_gather: closed forms, no plan

    return int(simulate_algorithm(simulator_name(args), args.context_parallel_size, cluster, w, tp=tp).peak_bytes)

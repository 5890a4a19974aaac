"""Both directions of one ring share one channel in the simulator and the greedy planner, as they
do on NCCL: every batched P2P on a process group runs on that group's one communicator and its one
NCCL stream (ProcessGroupNCCL ``pointToPoint``: a batch takes ``getKeyFromDevice``, the key its
collectives use; DESIGN.md 6b), so the +1 and -1 transfers of a ring run one after the other. The
row and column rings are different groups and overlap."""

from __future__ import annotations

from megatron_mesh_cp.planning.cluster import Workload
from megatron_mesh_cp.planning.greedy import ChainConfig, PlanCost, _Greedy
from megatron_mesh_cp.planning.replay import replay
from megatron_mesh_cp.planning.schedule import build_plans, default_cluster
from megatron_mesh_cp.runtime.plan import FORWARD


def _lanes(timeline):
    """ring -> [(start, finish, direction)] of the recorded rank's transfers, in start order."""
    out = {}
    for lane, start, fin, _what in timeline:
        if lane[:3] in ("row", "col"):
            out.setdefault(lane[:3], []).append((start, fin, lane[3]))
    return {ring: sorted(spans) for ring, spans in out.items()}


def test_replay_runs_the_two_directions_of_a_ring_one_after_the_other():
    """Plans whose chains split both ways (what documents and windows run): on every ring of the
    recorded rank no transfer starts before the previous one, in either direction, has finished;
    some opposite-direction transfer waits exactly for it (the shared channel binds); the row and
    column rings do overlap where they use different links (CP ranks 2 GPUs apart: the column rings
    cross nodes; rings on one link type share its egress)."""
    cluster = default_cluster()
    w = Workload(seq_local=8192, heads=32, kv_heads=8, head_dim=128)
    lat = max(cluster.inter_lat, cluster.intra_lat)
    crossed = 0
    for a, b in ((1, 8), (2, 4), (4, 2), (8, 1)):
        for plan in build_plans(a, b, cluster=cluster, workload=w, stride=2, chains="both-ways"):
            lanes = _lanes(replay(plan, cluster, w, stride=2, record=0).timeline)
            for ring, spans in lanes.items():
                if (a if ring == "row" else b) > 2:  # a ring of two has one neighbour: one way suffices
                    assert {d for _s, _f, d in spans} == {"+", "-"}, (a, b, plan.phase, ring)
                for (s0, f0, d0), (s1, f1, d1) in zip(spans, spans[1:]):
                    assert s1 >= f0 - 1e-12, (a, b, plan.phase, ring, (s0, f0, d0), (s1, f1, d1))
                    crossed += d0 != d1 and s1 - f0 <= lat + 1e-12
            if len(lanes) == 2:
                row, col = lanes["row"], lanes["col"]
                assert any(s < g and t < f for s, f, _ in row for t, g, _ in col), (a, b, plan.phase)
    assert crossed > 0


def test_greedy_planner_keys_its_channel_by_ring():
    """The planner's clock: after a +1 transfer on the row ring, a -1 transfer on the row ring cannot
    start before it has finished and landed; one on the column ring (another link type: no shared
    egress) can start at once."""
    cost = PlanCost(block=1.0, call=0.1, fold={"o": 0.01}, transfer={"q": 2.0, "kv": 3.0, "o": 2.0},
                    latency={"row": 0.5, "col": 0.5}, link={"row": "intra", "col": "inter"})
    g = _Greedy(4, 4, FORWARD, cost, ChainConfig(split_gathers=True, max_inflight=2))
    assert g._transfer_start("q", -1, 0.0) == 0.0
    g._emit_transfer("q", 1, 0, 0.0)
    assert g._transfer_start("q", -1, 0.0) == 2.5  # finished (2.0) and landed (+0.5)
    assert g._transfer_start("kv", 1, 0.0) == 0.0

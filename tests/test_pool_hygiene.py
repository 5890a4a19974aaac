"""Releasing process groups: MeshGroups.destroy() and ``with MeshGroups.create(...)`` free what create made
(each gloo group holds three threads), adopted groups stay the caller's, and a pooled rank's threads and
memory stay flat over many tasks that build groups of their own (Megatron's, wrong rings, meshes)."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_mesh_cp.spawn import RankError

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None


@pytest.mark.parametrize("shape,ulysses,groups", [((2, 2), 1, 2), ((1, 2), 2, 3)], ids=["mesh-2x2", "a2a+mesh-2x1x2"])
def test_destroy_releases_the_groups_create_made(pools, shape, ulysses, groups):
    res = pools.get(4).run("rank_tasks_groups:destroy_cycle", shape, ulysses)
    for r in res:
        before, during, after = r["before"], r["during"], r["after"]
        assert during["groups"] == before["groups"] + groups and during["Threads"] > before["Threads"], r
        assert after["groups"] == before["groups"] and after["Threads"] == before["Threads"], r
        assert all(r["gone"]) and r["groups"] == (None, None, None) and "destroyed" in r["repr"]
        assert "was destroyed (mesh.destroy()); build a new one with MeshGroups.create" in r["error"], r["error"]


def test_with_block_releases_the_groups_also_on_an_error(pools):
    for r in pools.get(4).run("rank_tasks_groups:with_block", (1, 4)):
        assert r["inside"] == r["before"] + 2 and r["after"] == r["after_error"] == r["before"], r


def test_with_block_raises_its_own_error_when_a_group_was_destroyed_elsewhere(pools):
    for r in pools.get(4).run("rank_tasks_groups:with_block_group_gone", (2, 2)):
        assert r["raised"] == "KeyError: 'boom'" and r["after"] == r["before"] and r["destroyed"], r


def test_destroy_leaves_adopted_groups_to_their_owner(pools):
    for r in pools.get(4).run("rank_tasks_groups:adopted_stay"):
        assert r["kept"] and r["sum"] == 4.0 and r["destroyed"], r  # both rings still all-reduce (2 x 2 ranks)
        assert r["groups_after"] == r["groups_before"], r


#: rank tasks of the suite that build process groups of their own (name, args, raises)
GROUP_TASKS = [
    ("rank_tasks_faults:timeouts", (7,), False),
    ("rank_tasks_faults:from_groups_one_bad", (), False),
    ("rank_tasks:bad_input", ("group_members",), True),
    ("rank_tasks_hybrid:bad_input", ("ulysses_group",), True),
    ("rank_tasks_groups:destroy_cycle", ((2, 1), 2), False),
]
MEGATRON_TASKS = [
    ("rank_tasks_faults:megatron_timeout", (3,), False),
    ("rank_tasks_hybrid:megatron_groups", ([2, 1, 2],), False),
    ("rank_tasks_megatron:gpt_direct", (4, (2, 2)), False),
]
ROUNDS = 4


def _round(pool):
    for name, args, raises in GROUP_TASKS + (MEGATRON_TASKS if HAS_MEGATRON else []):
        if raises:
            with pytest.raises(RankError, match="ValueError"):
                pool.run(name, *args)
        else:
            pool.run(name, *args)
    return pool.run("rank_groups:proc_status")


def test_pooled_ranks_keep_threads_and_memory_flat_over_many_tasks(pools):
    pool = pools.get(4)
    start = _round(pool)  # the first round warms up (imports, lazily started threads, allocator)
    for _ in range(ROUNDS - 1):
        end = _round(pool)
    tasks = ROUNDS * (len(GROUP_TASKS) + len(MEGATRON_TASKS) * HAS_MEGATRON)
    print(f"[pool] {tasks} group-building tasks: threads per rank {[s['Threads'] for s in start]} -> "
          f"{[e['Threads'] for e in end]}, VmRSS MiB {[s['VmRSS'] // 1024 for s in start]} -> "
          f"{[e['VmRSS'] // 1024 for e in end]}, live groups {start[0]['groups']} -> {end[0]['groups']}")
    for s, e in zip(start, end):
        assert e["groups"] == s["groups"] and e["Threads"] == s["Threads"], (s, e)
        assert e["VmRSS"] - s["VmRSS"] <= 64 * 1024, (s, e)  # kB: no model, buffer or group left behind per round

"""mesh_shape=auto's disk cache: the same choice as planning it, read back without planning; keyed by every
input, the planner's sources included; written atomically; a bad entry or an unwritable directory costs only
the cache."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import replace

import pytest

from megatron_mesh_cp.planning import autoshape, shape_cache
from megatron_mesh_cp.planning.cluster import Workload, load_cluster
from megatron_mesh_cp.planning.shape_cache import cache_dir, cached_choice

H100 = load_cluster("h100-ib400")
W = Workload(seq_local=2048, heads=8, kv_heads=2, head_dim=64)


def _no_planning(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("planned, but the cache holds the answer")

    monkeypatch.setattr(autoshape, "choose_shape", fail)
    monkeypatch.setattr(autoshape, "choose_hybrid_shape", fail)


@pytest.mark.parametrize("kind,n", [("mesh", 16), ("a2a+mesh", 16)])
def test_cached_choice_is_the_planned_one_and_reads_back_without_planning(tmp_path, monkeypatch, kind, n):
    planned = (autoshape.choose_shape if kind == "mesh" else autoshape.choose_hybrid_shape)(n, H100, W, stride=2)
    first = cached_choice(kind, n, H100, W, stride=2, directory=tmp_path)
    assert first == planned and len(list(tmp_path.glob("*.json"))) == 1
    _no_planning(monkeypatch)
    again = cached_choice(kind, n, H100, W, stride=2, directory=tmp_path)
    assert again == planned and type(again) is type(planned)


def test_every_input_and_the_planner_sources_are_in_the_key(tmp_path, monkeypatch):
    cached_choice("mesh", 8, H100, W, directory=tmp_path)
    variants = [dict(n=4), dict(workload=replace(W, kv_heads=8)), dict(stride=2), dict(max_live=40),
                dict(memory_budget=1e12), dict(cluster=load_cluster("a100-ib200")), dict(even=True)]
    for v in variants:
        kw = dict(dict(n=8, cluster=H100, workload=W), **v)
        cached_choice("mesh", kw.pop("n"), kw.pop("cluster"), kw.pop("workload"), directory=tmp_path, **kw)
    assert len(list(tmp_path.glob("*.json"))) == 1 + len(variants)
    monkeypatch.setattr(shape_cache, "source_digest", lambda: "a changed planner")
    cached_choice("mesh", 8, H100, W, directory=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2 + len(variants)


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
    """Ranks filling the same entry at once: every read sees a complete file, no temporary file is left."""
    choice = cached_choice("mesh", 8, H100, W, directory=tmp_path)
    (path,) = tmp_path.glob("*.json")
    key = json.loads(path.read_text())["key"]
    seen, stop = [], threading.Event()

    def write():
        for _ in range(40):
            shape_cache._write(path, key, choice)

    def read():
        while not stop.is_set():
            seen.append(shape_cache._read(path, key, "mesh"))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write) for _ in range(6)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert seen and all(s == choice for s in seen)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_bad_entry_is_replanned_and_replaced(tmp_path, caplog):
    choice = cached_choice("mesh", 8, H100, W, directory=tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text('{"key": ')  # e.g. a disk that filled up under another writer
    caplog.set_level(logging.WARNING, logger="megatron_mesh_cp")
    assert cached_choice("mesh", 8, H100, W, directory=tmp_path) == choice
    assert "ignoring unreadable cache entry" in caplog.text and json.loads(path.read_text())["choice"]


def test_an_unwritable_directory_only_costs_the_cache(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    caplog.set_level(logging.WARNING, logger="megatron_mesh_cp")
    assert cached_choice("mesh", 8, H100, W, directory=blocker / "shapes") == autoshape.choose_shape(8, H100, W)
    assert "cannot write the shape cache" in caplog.text and "MESH_CP_CACHE_DIR" in caplog.text


def test_cache_directory_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MESH_CP_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("MESH_CP_CACHE_DIR", "")
    assert cache_dir() is None
    monkeypatch.delenv("MESH_CP_CACHE_DIR")
    assert cache_dir().parts[-2:] == ("megatron-mesh-cp", "shapes")


def test_megatron_arguments_resolve_auto_through_the_cache(monkeypatch, tmp_path):
    pytest.importorskip("megatron.core")
    from test_megatron_integration import _flat

    from megatron_mesh_cp.megatron.arguments import apply_mesh_args

    monkeypatch.setenv("MESH_CP_CACHE_DIR", str(tmp_path))
    first = apply_mesh_args(_flat(context_parallel_size=16, context_parallel_algo="mesh", seq_length=16 * 4096), argv=[])
    assert len(list(tmp_path.glob("*.json"))) == 1
    _no_planning(monkeypatch)
    again = apply_mesh_args(_flat(context_parallel_size=16, context_parallel_algo="mesh", seq_length=16 * 4096), argv=[])
    assert again.hierarchical_context_parallel_sizes == first.hierarchical_context_parallel_sizes


def test_the_preflight_resolves_auto_once_and_fills_the_cache_the_ranks_read(monkeypatch, tmp_path):
    pytest.importorskip("megatron.training")
    from megatron_runs import write_config

    from megatron_mesh_cp.megatron.preflight import run_checks

    monkeypatch.setenv("MESH_CP_CACHE_DIR", str(tmp_path / "shapes"))
    cfg = write_config(tmp_path, "auto16", context_parallel_size=16, context_parallel_algo="mesh", mesh_shape="auto",
                       seq_length=16 * 4096, max_position_embeddings=16 * 4096, mock_data=True)
    (check,) = [c for c in run_checks(str(cfg), software=False) if c.name == "mesh settings"]
    assert check.ok and check.detail.startswith("mesh ") and "auto" in check.detail and str(tmp_path) in check.detail
    assert len(list((tmp_path / "shapes").glob("*.json"))) == 1
    bad = write_config(tmp_path, "bad", context_parallel_size=16, context_parallel_algo="mesh", mesh_shape="3x3",
                       mock_data=True)
    (check,) = [c for c in run_checks(str(bad), software=False) if c.name == "mesh settings"]
    assert not check.ok and "3x3" in check.detail
    lay = write_config(tmp_path, "lay", context_parallel_size=4, context_parallel_algo="mesh", mesh_shape="2x2",
                       mesh_layout="zigzag", mock_data=True)  # every --mesh-* flag is checked, not only the shape
    (check,) = [c for c in run_checks(str(lay), software=False) if c.name == "mesh settings"]
    assert not check.ok and "--mesh-layout lays out the documents" in check.detail

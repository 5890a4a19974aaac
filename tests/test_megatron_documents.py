"""Megatron's --reset-attention-mask under mesh CP, through Megatron's real training loop.

The stdlib corpus cut into a few long documents among many short ones (a cycle of 60, 30 and
4-byte documents, 128-token sequences), with ``--reset-attention-mask --reset-position-ids
--eod-mask-loss``: CP = 4 mesh 2x2 and a2a+mesh 2x1x2 take each micro-batch's documents from its EOD
tokens (unpadded, pruned plans, no dense mask), CP = 1 runs Megatron's own local attention on the
dataloader's dense mask. Per-iteration lm loss over 10 iterations and every first-step gradient
agree to 1e-5: the mesh run with ``--mesh-layout split-half`` (the long documents cut into pieces over
half of each mesh row's chunks where they fit, else over every chunk; RoPE at each token's own
position; ``split`` itself runs in test_megatron_composition.py), the a2a+mesh run with the default ``auto`` (the
layout the cost model picks per micro-batch). The same runs composed with TP (and sequence
parallel), PP, DP, the distributed optimizer and recompute are in test_megatron_composition.py.
Refusals (a mask a path would drop) exit before training.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("megatron.training", reason="megatron-core >= 0.17 (Python 3.12) is needed")

from megatron_runs import run_bad_args, train, write_config  # noqa: E402
from test_megatron_composition import DOCS, ITERS, grad_diff, loss_diff  # noqa: E402

from megatron_mesh_cp.megatron.arguments import MeshArgumentError, apply_mesh_args  # noqa: E402
from megatron_mesh_cp.megatron.settings import options  # noqa: E402

MESH4 = dict(DOCS, context_parallel_size=4, create_attention_mask_in_dataloader=False, train_iters=ITERS)
#: a few long documents among many short ones: longer than a CP chunk (32 tokens at CP = 4) and short
DOC_DATA = ["--stdlib-doc-bytes", "60,4,4,4,4,4,4,30,4,4,4,4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("documents")
    return {
        "cp1": train(work, "cp1", 1, extra=DOC_DATA, **dict(DOCS, train_iters=ITERS)),
        "mesh2x2": train(work, "mesh2x2", 4, extra=DOC_DATA,
                         **dict(MESH4, context_parallel_algo="mesh", mesh_shape="2x2", mesh_layout="split-half",
                                mesh_plan_search=40)),
        "a2a2x1x2": train(work, "a2a2x1x2", 4, extra=DOC_DATA,
                          **dict(MESH4, context_parallel_algo="a2a+mesh", mesh_shape="2x1x2")),
    }


@pytest.mark.parametrize("name", ["mesh2x2", "a2a2x1x2"])
def test_document_masking_matches_megatrons_dense_mask(runs, name):
    got, ref = runs[name], runs["cp1"]
    dl, dg = loss_diff(got["losses"], ref["losses"]), grad_diff(got["grads_path"], ref["grads_path"])
    print(f"[documents] {name} vs CP=1 dense mask: max rel loss diff {dl:.2e}, max rel grad diff {dg:.2e}, "
          f"{got['attention_bytes_sent_per_rank']} attention bytes per rank (Ring: {got['ring_bytes_per_rank']})")
    assert len(got["losses"]) == ITERS and dl <= 1e-5 and dg <= 1e-5, (name, dl, dg)
    assert got["document_attention_calls"] == got["attention_calls"] > 0  # every call masked documents
    # the documents ran re-laid (split: cut into pieces; auto: what the cost model chose): the loss is CP = 1's
    ran = got["layouts"]["micro_batches"]
    assert got["layout"] == {"mesh2x2": "split-half", "a2a2x1x2": "auto"}[name] and got["document_batches_reordered"] > 0, got
    assert sum(ran.values()) == 2 * ITERS, ran  # every micro-batch laid out once (2 per iteration)
    # each chosen where its sample was loaded (the data loader), not on the step's critical path
    assert got["layouts"]["chosen_ahead"] == 2 * ITERS and got["layouts"]["ahead_choice_ms_mean"] > 0, got["layouts"]
    if name == "mesh2x2":  # split-half: the long documents over half of each mesh row's chunks where they fit
        assert all(k.startswith("split:") for k in ran) and any(k.count(":") == 2 for k in ran), ran
        # the micro-batches whose documents fit no half rows ran over every chunk: counted as such, not only by name
        over = sum(v for k, v in ran.items() if k.count(":") < 2)
        assert got["layouts"].get("split_half_over_every_chunk", 0) == over, got["layouts"]
    assert 1.0 <= got["layouts"]["busiest_over_mean_mean"] <= got["layouts"]["busiest_over_mean_max"], got["layouts"]
    assert got["plan_search"] == {"mesh2x2": 40, "a2a2x1x2": 0}[name]  # searched plans ran exactly too
    if name == "mesh2x2":  # every search ran in the data loader's workers; the step took their orders
        assert got["plan_searches_ahead"] > 0 and got["plan_searches_in_step"] == 0, got
    assert ref["losses"][-1][1] < ref["losses"][0][1]  # it learns


BAD = [
    (["--reset-attention-mask"], "pass --no-create-attention-mask-in-dataloader"),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader", "--micro-batch-size", "2",
      "--global-batch-size", "2"], "use --micro-batch-size 1 (got 2)"),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader", "--mesh-packed-data",
      "--calculate-per-token-loss"], "two ways to mask documents"),
    (["--eod-mask-loss"], "--eod-mask-loss with CP > 1 needs --calculate-per-token-loss"),
    (["--mesh-document-order", "given"], "there are none to lay out in this run (it has no --reset-attention-mask, "
                                         "so attention crosses document boundaries): drop it"),
]


def test_masking_a_path_would_drop_is_refused_before_training(tmp_path):
    cfg = write_config(tmp_path, "docs-bad", micro_batch_size=1, global_batch_size=2, context_parallel_size=4,
                       context_parallel_algo="mesh", mesh_shape="2x2")
    cases = [["--config", str(cfg)] + argv for argv, _ in BAD]
    cp1 = write_config(tmp_path, "docs-bad-cp1", micro_batch_size=1, global_batch_size=2)
    cases.append(["--config", str(cp1), "--reset-attention-mask", "--no-create-attention-mask-in-dataloader"])
    needles = [n for _, n in BAD] + ["no attention would see the documents"]
    p2p = write_config(tmp_path, "docs-bad-p2p", micro_batch_size=1, global_batch_size=2, context_parallel_size=4,
                       context_parallel_algo="p2p")
    cases.append(["--config", str(p2p), "--reset-attention-mask", "--no-create-attention-mask-in-dataloader"])
    needles.append("Transformer Engine's causal attention ignores Megatron's dense document mask")
    for argv, needle, res in zip(cases, needles, run_bad_args(cases, tmp_path)):
        assert res["code"] == 2, (argv, res)
        assert needle in res["stderr"], (argv, res["stderr"])


def test_stock_pretrain_gpt_refuses_documents_it_cannot_pass():
    """Stock pretrain_gpt.py's get_batch does not hand the documents to the attention: refused there
    (the patched Megatron calls apply_mesh_args_or_exit, i.e. launcher=False), accepted for the launcher."""
    from test_megatron_integration import _flat

    args = _flat(context_parallel_algo="mesh", mesh_shape="2x2", context_parallel_size=4, reset_attention_mask=True,
                 create_attention_mask_in_dataloader=False)
    with pytest.raises(MeshArgumentError, match="needs megatron-mesh-cp's launcher"):
        apply_mesh_args(args, [], launcher=False)
    apply_mesh_args(args, [])
    assert options().documents == "eod"


def test_multi_token_prediction_over_documents_is_refused():
    """Megatron's MTP shifts its targets per document of the batch's PackedSeqParams as THD sequences split
    per document over the CP ranks; mesh CP's documents split the whole sequence: refused, naming the fix."""
    from test_megatron_integration import _flat

    base = dict(context_parallel_algo="mesh", mesh_shape="2x2", context_parallel_size=4, reset_attention_mask=True,
                create_attention_mask_in_dataloader=False)
    with pytest.raises(MeshArgumentError, match="--mtp-num-layers with --reset-attention-mask under mesh CP.*drop "
                                                "--mtp-num-layers or --reset-attention-mask"):
        apply_mesh_args(_flat(**base, mtp_num_layers=1), [])
    apply_mesh_args(_flat(**base, mtp_num_layers=None), [])
    apply_mesh_args(_flat(**dict(base, reset_attention_mask=False), mtp_num_layers=1), [])  # no documents: fine


def test_plan_search_is_refused_where_no_pruned_plans_run():
    """--mesh-plan-search re-orders masked attention's pruned plans: refused without documents or a window
    under mesh CP, and for a negative count; taken with documents."""
    from test_megatron_integration import _flat

    base = dict(context_parallel_algo="mesh", mesh_shape="2x2", context_parallel_size=4, reset_attention_mask=True,
                create_attention_mask_in_dataloader=False)
    apply_mesh_args(_flat(**base, mesh_plan_search=8), [])
    assert options().plan_search == 8
    with pytest.raises(MeshArgumentError, match="--mesh-plan-search re-orders the pruned plans.*drop --mesh-plan-search"):
        apply_mesh_args(_flat(**dict(base, reset_attention_mask=False), mesh_plan_search=8), [])
    with pytest.raises(MeshArgumentError, match="give N >= 0, got -1"):
        apply_mesh_args(_flat(**base, mesh_plan_search=-1), [])
    nodocs = dict(base, reset_attention_mask=False)
    with pytest.raises(MeshArgumentError, match="a window that bounds nothing"):  # (-1, 0): causal, no window
        apply_mesh_args(_flat(**nodocs, mesh_plan_search=8, window_size=(-1, 0)), [])
    apply_mesh_args(_flat(**nodocs, mesh_plan_search=8, window_size=(128, 0)), [])  # a window: pruned plans
    assert options().plan_search == 8
    apply_mesh_args(_flat(**dict(base, reset_attention_mask=False), mesh_plan_search=0), [])
    assert options().plan_search == 0
    # a2a+mesh Ux1x1: Ulysses alone, a 1x1 mesh whose plans are one block and no transfer, nothing to re-order
    ulysses = dict(base, context_parallel_algo="a2a+mesh", mesh_shape="4x1x1", num_attention_heads=8,
                   num_query_groups=8)
    with pytest.raises(MeshArgumentError, match="mesh 4x1x1.*nothing to re-order"):
        apply_mesh_args(_flat(**ulysses, mesh_plan_search=8), [])
    apply_mesh_args(_flat(**ulysses, mesh_plan_search=0), [])
    apply_mesh_args(_flat(**dict(ulysses, mesh_shape="2x1x2"), mesh_plan_search=8), [])  # a 1x2 mesh: searched
    assert options().plan_search == 8


def test_layouts_the_model_cannot_re_lay_are_refused_or_narrowed_with_the_reason():
    """--mesh-layout split (and split-half, tiled-cut) cuts documents into pieces: refused where the model cannot follow the pieces
    (a sliding window, MLA's own rotary, other position embeddings), naming why; auto there keeps
    documents whole and says so; layouts without --reset-attention-mask are refused; the older
    --mesh-document-order must agree with --mesh-layout; split-half needs a mesh with both sides even (--mesh-shape
    auto chooses among those: 2x2 at CP = 4 where 1x4 is otherwise fastest, 2x2x2 at CP = 8 a2a+mesh where 8x1x1
    is; a CP size with none is refused before any shape is simulated)."""
    from test_megatron_integration import _flat

    from megatron_mesh_cp.megatron.pretrain import _masking

    base = dict(context_parallel_algo="mesh", mesh_shape="2x2", context_parallel_size=4, reset_attention_mask=True,
                create_attention_mask_in_dataloader=False)
    for extra, why in ((dict(window_size=(127, 0)), "a sliding window (--window-size)"),
                       (dict(position_embedding_type="yarn"), "--position-embedding-type yarn does not follow")):
        for cut in ("split", "split-half", "tiled-cut"):
            with pytest.raises(MeshArgumentError, match=f"--mesh-layout {cut} cuts documents into pieces, which "
                                                        + re.escape(why)):
                apply_mesh_args(_flat(**{**base, **extra}, mesh_layout=cut), [])
        apply_mesh_args(_flat(**{**base, **extra}), [])
        assert options().layout == "auto" and options().whole_documents and why in options().layout_note
        assert ("; each micro-batch's token layout: --mesh-layout auto keeps documents whole (zigzag, balanced or "
                "tiled, by the cost model): split and tiled-cut cut them into pieces, which ") in _masking(_flat())
    apply_mesh_args(_flat(**base), [])
    assert options().layout == "auto" and options().layout_note == "" and not options().whole_documents
    apply_mesh_args(_flat(**base, mesh_layout="split-half"), [])  # 2x2: both sides even
    with pytest.raises(MeshArgumentError, match="split-half .* needs a mesh a x b with a and b even; this run's mesh "
                                                "is 1x4: use --mesh-layout split .* both sides even \\(e.g. 2x2\\)"):
        apply_mesh_args(_flat(**dict(base, mesh_shape="1x4"), mesh_layout="split-half"), [])
    with pytest.raises(MeshArgumentError, match=r"mesh is 1x16: .* both sides even \(e.g. 4x4\)"):  # one for this CP
        apply_mesh_args(_flat(**dict(base, mesh_shape="1x16", context_parallel_size=16), mesh_layout="split-half"), [])
    with pytest.raises(MeshArgumentError, match=r"mesh is 1x4: .* both sides even \(e.g. 2x2x2\)"):  # a2a+mesh: UxAxB
        apply_mesh_args(_flat(**dict(base, context_parallel_algo="a2a+mesh", mesh_shape="2x1x4",
                                     context_parallel_size=8), mesh_layout="split-half"), [])
    with pytest.raises(MeshArgumentError, match=r"mesh is 1x6: .* or a CP size that is a multiple of 4 \(a x b = 6 has no such mesh\)"):
        apply_mesh_args(_flat(**dict(base, mesh_shape="1x6", context_parallel_size=6, seq_length=1200),
                              mesh_layout="split-half"), [])
    # --mesh-shape auto (the default) chooses among meshes with both sides even, and says so
    apply_mesh_args(_flat(**dict(base, mesh_shape=None), mesh_layout="split-half"), [])
    assert options().shape_explanation.startswith("mesh_shape=auto -> 2x2 for CP=4 among meshes with both sides "
                                                  "even (--mesh-layout split-half)"), options().shape_explanation
    args = apply_mesh_args(_flat(**dict(base, context_parallel_algo="a2a+mesh", mesh_shape=None, context_parallel_size=8),
                                 mesh_layout="split-half"), [])
    u, a, b = args.hierarchical_context_parallel_sizes
    assert u * a * b == 8 and a % 2 == 0 and b % 2 == 0, (u, a, b)
    assert "(a2a+mesh) -> " in options().shape_explanation and "both sides even" in options().shape_explanation
    for algo, cp in (("mesh", 2), ("mesh", 6), ("a2a+mesh", 2)):  # no even mesh for this CP: refused before choosing
        with pytest.raises(MeshArgumentError, match=rf"needs a mesh a x b with a and b even; CP = {cp} has none .*"
                                                    r"use --mesh-layout split \(over every chunk\)"):
            apply_mesh_args(_flat(**dict(base, context_parallel_algo=algo, mesh_shape=None, context_parallel_size=cp,
                                         seq_length=1200), mesh_layout="split-half"), [])
    # a model that cannot cut documents is refused for that reason, not for the CP size's lack of an even mesh
    with pytest.raises(MeshArgumentError, match=r"split-half cuts documents into pieces, which a sliding window"):
        apply_mesh_args(_flat(**dict(base, mesh_shape=None, context_parallel_size=6, seq_length=1200, window_size=(64, 0)),
                              mesh_layout="split-half"), [])
    with pytest.raises(MeshArgumentError, match="--mesh-layout lays out the documents of --reset-attention-mask"):
        apply_mesh_args(_flat(**dict(base, reset_attention_mask=False), mesh_layout="zigzag"), [])
    with pytest.raises(MeshArgumentError, match=r"none to lay out in this run \(CP = 1 runs Megatron's dense mask\)"):
        apply_mesh_args(_flat(reset_attention_mask=True, create_attention_mask_in_dataloader=True,
                              context_parallel_size=1, mesh_layout="tiled"), [])
    with pytest.raises(MeshArgumentError, match="--mesh-document-order given is --mesh-layout zigzag, which "
                                                "contradicts --mesh-layout split"):
        apply_mesh_args(_flat(**base, mesh_layout="split", mesh_document_order="given"), [])


def test_split_half_on_an_a2a_mesh_with_no_even_sides_names_a_smaller_ulysses_degree():
    """a2a+mesh at CP = 8 with U = 4 or 8 leaves a 1x2 or 1x1 mesh: the refusal names a --mesh-shape whose mesh
    part has both sides even (2x2x2), not a CP size that is a multiple of 4 (CP = 8 is one); where no Ulysses
    degree leaves one (CP = 6), it names a CP size that is a multiple of 4."""
    from test_megatron_integration import _flat

    base = dict(context_parallel_algo="a2a+mesh", context_parallel_size=8, reset_attention_mask=True,
                create_attention_mask_in_dataloader=False)
    for shape in ("4x1x2", "8x1x1"):
        with pytest.raises(MeshArgumentError, match=r"mesh is 1x[12]: .* or a --mesh-shape with both sides even "
                                                    r"\(e.g. 2x2x2\)$"):
            apply_mesh_args(_flat(**dict(base, mesh_shape=shape), mesh_layout="split-half"), [])
    with pytest.raises(MeshArgumentError, match=r"mesh is 1x2: .* or a CP size that is a multiple of 4 "
                                                r"\(a x b = 2 has no such mesh\)"):
        apply_mesh_args(_flat(**dict(base, mesh_shape="3x1x2", context_parallel_size=6, seq_length=1200,
                                     num_attention_heads=6), mesh_layout="split-half"), [])


def test_the_summary_names_the_layout_that_ran_and_why_auto_kept_documents_whole(caplog):
    """The closing summary's layout line says --mesh-layout auto's narrowing (not a flag nobody passed)."""
    import logging

    from megatron_mesh_cp.megatron.pretrain import _print_summary

    lay = {"micro_batches": {"balanced": 3}, "busiest_over_mean_mean": 1.1, "busiest_over_mean_max": 1.2,
           "host_ms_mean": 2.0, "host_ms_max": 3.0}
    base = dict(losses=[], attention_calls=0, seconds=1.0, layouts=lay, layout="balanced")
    for note, says in ((None, "token layouts (--mesh-layout balanced): balanced x 3"),
                       ("--mesh-layout auto keeps documents whole (zigzag, balanced or tiled, by the cost model): "
                        "split cuts them into pieces, which a sliding window",
                        "token layouts (--mesh-layout auto keeps documents whole (zigzag, balanced or tiled")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_mesh_cp"):
            _print_summary(dict(base, layout_note=note))
        assert says in caplog.text


def test_the_summary_counts_the_calls_that_masked_documents_under_their_name():
    """document_attention_calls counts every call that masked documents, unpadded ones from EOD (sbhd) as well as
    packed THD ones (the old key, packed_attention_calls, said packed but counted both)."""
    import copy
    import time
    from types import SimpleNamespace

    import torch

    from megatron_mesh_cp.megatron import settings
    from megatron_mesh_cp.megatron.pretrain import _summary

    counters = settings.COUNTERS  # the one object the launcher's modules imported: reset in place, then restored
    saved = copy.deepcopy(vars(counters))
    vars(counters).update(vars(settings.MeshCounters()))
    try:
        q = torch.zeros(8, 1, 2, 4)  # [s, b, h, d]
        counters.count_call(q, q, 4, training=True, documents=True)  # unpadded documents (sbhd)
        counters.count_call(q, q, 4, training=True)  # no documents
        got = _summary(SimpleNamespace(context_parallel_size=4), None, time.time())
    finally:
        vars(counters).update(saved)
    assert got["attention_calls"] == 2 and got["document_attention_calls"] == 1, got
    assert "packed_attention_calls" not in got


def test_the_dry_run_states_every_layout_the_launcher_accepts():
    """Each --mesh-layout value has its line in the dry run's masking statement (a value without one failed there)."""
    from dataclasses import replace

    from test_megatron_integration import _flat

    from megatron_mesh_cp.megatron import settings
    from megatron_mesh_cp.megatron.layout import LAYOUT_CHOICES
    from megatron_mesh_cp.megatron.pretrain import _masking

    resolved = settings.options()
    try:
        for layout in LAYOUT_CHOICES:
            settings.configure(replace(resolved, documents="eod", layout=layout, layout_note=""))
            assert f"(--mesh-layout {layout}" in _masking(_flat()), layout
    finally:
        settings.configure(resolved)


def test_dry_run_states_the_masking(tmp_path):
    from megatron_runs import LAUNCHER, env, run_script

    cfg = write_config(tmp_path, "docs-dry", **MESH4, context_parallel_algo="mesh", mesh_shape="2x2")
    e = env(tmp_path)
    e.update(WORLD_SIZE="4", RANK="0")
    code, stdout, stderr = run_script(tmp_path, "docs-dry", LAUNCHER, ["--config", str(cfg), "--dry-run"], e)
    assert code == 0, stderr[-3000:]
    assert "document masking: from EOD (--reset-attention-mask), unpadded" in stdout + stderr
    assert "each micro-batch's token layout chosen by the cost model (--mesh-layout auto" in stdout + stderr
    assert "vocabulary assumed" not in stdout + stderr  # the stdlib's byte-level vocabulary, as the job trains


def test_split_half_says_when_a_micro_batch_ran_over_every_chunk(caplog):
    """split-half lays a micro-batch whose long documents fit no half rows out as split would (documented): the log says
    so once and the summary counts those micro-batches; a half-row one, or another layout, counts nothing."""
    import logging
    from dataclasses import replace

    from megatron_mesh_cp.megatron import layout, settings
    from megatron_mesh_cp.runtime import arrange

    lengths = [40, 40, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]  # 192 tokens on 4 chunks: pieces of 24
    whole, cut = arrange(lengths, 4, "split", split=2), arrange(lengths, 4, "split", split=1, shape=(2, 2), halves=1)
    assert whole.halves == 0 and cut.halves == 1
    resolved, counters = settings.options(), settings.COUNTERS
    saved = dict(vars(counters))
    try:
        counters.over_every_chunk = 0
        settings.configure(replace(resolved, layout="split-half"))
        with caplog.at_level(logging.WARNING, logger="megatron_mesh_cp"):
            for arr in (cut, whole, whole, cut):
                layout._note_split_half(arr)
        assert counters.over_every_chunk == 2
        assert caplog.text.count("fit no half of each mesh row's chunks, so it runs as split:2") == 1, caplog.text
        settings.configure(replace(resolved, layout="split"))
        layout._note_split_half(whole)
        assert counters.over_every_chunk == 2  # split itself: nothing to say
    finally:
        settings.configure(resolved)
        vars(counters).update(saved)

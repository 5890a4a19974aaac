"""install_rotary's RotaryEmbedding.forward under a layout that cuts documents (megatron/layout.py): each
re-laid token rotated at its original position, this CP rank's share taken as Megatron's zigzag split takes it,
and the positions on the device the embedding is on (under --use-cpu-initialization inv_freq lives on the host
until get_emb's first call moves it to the GPU)."""

from __future__ import annotations

import pytest
import torch

rope = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")

from megatron_mesh_cp.megatron import layout  # noqa: E402


class _Group:
    """A CP group as RotaryEmbedding reads it (size and rank only)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _zigzag(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of dim 0: of 2·CP equal chunks, chunk r and chunk 2·CP-1-r (how Megatron's
    get_batch_on_this_cp_rank splits the tokens)."""
    chunks = x.chunk(2 * group.size(), dim=0)
    return torch.cat([chunks[group.rank()], chunks[2 * group.size() - 1 - group.rank()]], dim=0)


@pytest.fixture
def installed(monkeypatch):
    cls = rope.RotaryEmbedding
    monkeypatch.setattr(cls, "forward", cls.forward)  # restored after the test
    monkeypatch.setattr(cls, "_mesh_layout_forward", None, raising=False)
    layout.install_rotary()
    return cls


def _seen(monkeypatch):
    """get_pos_emb_on_this_cp_rank replaced by the zigzag split (Megatron's pins host memory and moves its
    index to the GPU), noting the device of every tensor it is handed."""
    devices = []

    def split(pos, seq_dim, group):
        assert seq_dim == 0
        devices.append(pos.device)
        return _zigzag(pos, group)

    monkeypatch.setattr(rope, "get_pos_emb_on_this_cp_rank", split)
    return devices


@pytest.mark.parametrize("interleaved,scaling", [(False, False), (True, False), (False, True)])
def test_each_re_laid_token_is_rotated_at_its_original_position(installed, monkeypatch, interleaved, scaling):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # get_emb's move of inv_freq: stays here
    _seen(monkeypatch)
    seq, cp = 32, 2
    order = torch.randperm(seq, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(layout.CURRENT, "positions", order)
    for r in range(cp):
        group = _Group(cp, r)
        emb = rope.RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_interleaved=interleaved,
                                   rope_scaling=scaling, rope_scaling_factor=8.0, rotary_base=500000,
                                   use_cpu_initialization=True, cp_group=group)
        got = emb(seq)
        whole = emb.get_emb(seq)  # Megatron's embedding of positions 0..seq-1, [s, 1, 1, d]
        assert got.shape == (seq // cp,) + whole.shape[1:]
        torch.testing.assert_close(got, whole[_zigzag(order, group)], rtol=0, atol=0)


def test_positions_follow_the_embedding_to_the_device_get_emb_moved_it_to(installed, monkeypatch):
    """--use-cpu-initialization: inv_freq is on the host until the first get_emb moves it to the GPU. The
    positions must go to the embedding's device; taken to inv_freq's device before get_emb ran they stayed on the
    host, and on a GPU the CP split (an index on the GPU) and index_select refused the mix of devices."""
    accelerator = torch.device("meta")  # stands for the GPU: a device other than the host's
    monkeypatch.setattr(torch.cuda, "current_device", lambda: accelerator)
    devices = _seen(monkeypatch)
    # the launcher's positions are on the GPU already, and the old forward copied them to the host (inv_freq's
    # device then); a meta tensor cannot be copied out, so here they start on the host and must reach the embedding
    monkeypatch.setattr(layout.CURRENT, "positions", torch.randperm(16))
    emb = rope.RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True, cp_group=_Group(2, 1))
    assert emb.inv_freq.device.type == "cpu"
    got = emb(16)
    assert devices == [accelerator], devices
    assert got.device == accelerator and got.shape == (8, 1, 1, 8)


def test_megatron_s_memo_stays_clearable(installed):
    """Megatron-Bridge's eval CP rebinding and the tests' teardown clear RotaryEmbedding.forward's lru_cache
    through ``forward.cache_clear``; the installed forward keeps it."""
    assert installed.forward.cache_clear == installed._mesh_layout_forward.cache_clear

"""``flash`` backend: FlashAttention-3 (``flash_attn_interface``, the hopper/ build) where its build
can run on this GPU, else FlashAttention-2 (``flash_attn`` >= 2.6), through their
``_flash_attn_forward`` / ``_flash_attn_backward`` as ring-flash-attn and TE call them.

The call surfaces, read from the sources (flash-attention v2.6.0 .. v2.8.3 and hopper/ history):

* FA2 2.6.x: ``window_size`` is a tuple; the forward returns ``(out, q, k, v, out_padded, lse,
  S_dmask, rng_state)``; the backward returns ``(dq, dk, dv, softmax_d)``.
* FA2 2.7.0+: ``window_size_left`` / ``window_size_right``; the forward returns ``(out, lse,
  S_dmask, rng_state)``; both are ``torch.library.custom_op`` objects (torch >= 2.4) whose own
  signature is ``(*args, **kwargs)`` -- the wrapped function (``_init_fn``) has the real one.
* FA3, first form (2024-07 .. 2024-12): ``(q, k, v, softmax_scale, causal[, window_size, ...])``,
  forward returns ``(out, q, k, v, out_padded, lse, S_dmask)``; sm90 only.
* FA3 since 2025-01: many leading arguments (``k_new``, ``out``, ``cu_seqlens_*``, ...), required
  until 2025-08 and defaulted after; ``causal`` in the backward until 2025-07, ``is_causal`` after;
  ``window_size`` tuple until 2025-07, ``_left``/``_right`` after; sm80+ (from 2025-01-08). Since
  2025-09-17 ``hopper/flash_api.cpp`` refuses a deterministic backward for head dims rounded up to
  256 (193..256); builds cannot be told apart from Python, so FA3 is never used for that (FA2 is).
  MLA (a value head dim of its own): FA3 on Hopper (sm90) only, forward since 2025-02-03 and
  backward since 2025-04-24 (not told apart from Python: MLA needs an FA3 built from 2025-04-24 on);
  the backward takes ``max(d, dv) <= 256``, the deterministic rule reads ``max(d, dv)``.

Arguments are bound by the parameter names the installed build declares, so every form gets
exactly what it asks for; a required parameter we do not know makes the build unusable (the kernel
then uses FA2 if it can). dq/dk/dv (and FA3's out, where it takes one) are written into
sequence-major buffers we own through ``[b, s, h, d]`` views, so results come back contiguous
(FA3's out too where its forward is a plain function; a custom op may not return its input).
FA2/FA3 align a causal mask bottom-right; every causal block here is square (``check_square``).

Packed sequences (THD): ``_flash_attn_varlen_forward`` / ``_backward`` (FA2; FA3 where the build
has them), or FA3's one entry point where it takes ``cu_seqlens_q`` itself (builds since 2025-01),
bound by name the same way; q and kv share the batch's ``cu_seqlens`` (every packed sub-block is
square per document) and the lse is ``[h, total]``, as FA2 >= 2.6 and FA3 return it.
"""

from __future__ import annotations

import inspect
import re
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch

from .base import BlockKernel, Varlen, check_cuda_half, check_square

__all__ = ["FlashKernel", "flash_version", "GRAD_SHAPES"]

#: block shapes whose dq/dk/dv buffers the flash kernel keeps (least recently used dropped first): a
#: layer's plan has a handful of block shapes; document sub-blocks get new ones every batch and rank
GRAD_SHAPES = 8


def _fa3():
    import flash_attn_interface as m  # the hopper/ build of flash-attention

    return m


def _fa2():
    import flash_attn
    from flash_attn import flash_attn_interface as m

    return m, getattr(flash_attn, "__version__", "0")


def flash_version():
    """(3, module) or (2, module) for the best flash-attn importable here; raises ImportError if none."""
    try:
        return 3, _fa3()
    except ImportError:
        pass
    return 2, _fa2()[0]


def _signature(fn) -> inspect.Signature:
    """The real signature, also through ``torch.library.custom_op`` (which keeps it on ``_init_fn``)."""
    return inspect.signature(getattr(fn, "_init_fn", fn))


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)


class _Surface:
    """One installed build's forward/backward, called by parameter name."""

    def __init__(self, label: str, mod, min_sm: int, lse_index: int, deterministic_ok: bool, det_head_dim: int = 256):
        self.label, self.min_sm, self.lse_index = label, min_sm, lse_index
        self.fwd, self.bwd = mod._flash_attn_forward, mod._flash_attn_backward
        self.fwd_sig, self.bwd_sig = _signature(self.fwd), _signature(self.bwd)
        self.deterministic_ok, self.det_head_dim = deterministic_ok, det_head_dim
        # an output buffer only where the forward is a plain function: a custom op may not return
        # (an alias of) one of its inputs, so FA3 builds wrapped as custom ops allocate their own
        self.takes_out = not hasattr(self.fwd, "_init_fn") and "out" in self.fwd_sig.parameters
        self.vfwd, self.vbwd = getattr(mod, "_flash_attn_varlen_forward", None), getattr(mod, "_flash_attn_varlen_backward", None)
        if (self.vfwd is None or self.vbwd is None) and "cu_seqlens_q" in self.fwd_sig.parameters \
                and "cu_seqlens_q" in self.bwd_sig.parameters:
            self.vfwd, self.vbwd = self.fwd, self.bwd  # FA3 since 2025-01: one entry point takes cu_seqlens
        self.varlen_error = f"{label} has no varlen entry points" if self.vfwd is None or self.vbwd is None else None
        if self.varlen_error is None:
            self.vfwd_sig, self.vbwd_sig = _signature(self.vfwd), _signature(self.vbwd)
            try:
                self._bind(self.vfwd_sig, _FIXED, f"{label} varlen forward")
                self._bind(self.vbwd_sig, _FIXED, f"{label} varlen backward")
            except ValueError as exc:
                self.varlen_error = str(exc)

    def deterministic_for(self, head_dim: int) -> bool:
        """Whether this build has a deterministic backward for ``head_dim``."""
        return self.deterministic_ok and head_dim <= self.det_head_dim

    @staticmethod
    def _bind(sig: inspect.Signature, values: Dict, what: str) -> Dict:
        """Keyword arguments for every parameter ``sig`` has and we know; a required one we do not
        know raises ``ValueError``."""
        kw = {}
        for name, p in sig.parameters.items():
            if name in values:
                kw[name] = values[name]
            elif p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ValueError(f"{what} takes a required argument {name!r} the flash kernel does not know")
        return kw

    def check_known(self) -> None:
        """Raise ``ValueError`` unless both entry points can be called with what we know."""
        self._bind(self.fwd_sig, _FIXED, f"{self.label} _flash_attn_forward")
        self._bind(self.bwd_sig, _FIXED, f"{self.label} _flash_attn_backward")

    def forward(self, q, k, v, causal: bool, scale: float, out: Optional[torch.Tensor], window=None):
        vals = dict(_FIXED, q=q, k=k, v=v, softmax_scale=scale, causal=causal, out=out, **_window_args(window))
        res = self.fwd(**self._bind(self.fwd_sig, vals, self.label))
        return res[0], res[self.lse_index]

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, causal: bool, scale: float, deterministic: bool,
                 window=None):
        vals = dict(_FIXED, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                    softmax_scale=scale, causal=causal, is_causal=causal, deterministic=deterministic,
                    **_window_args(window))
        self.bwd(**self._bind(self.bwd_sig, vals, self.label))

    def forward_varlen(self, q, k, v, varlen: Varlen, causal: bool, scale: float, window=None):
        """[t, h, d] tensors of one packed sub-block -> (out [t, h, d], lse [h, t])."""
        vals = dict(_FIXED, q=q, k=k, v=v, cu_seqlens_q=varlen.cu, cu_seqlens_k=varlen.cu, max_seqlen_q=varlen.max_len,
                    max_seqlen_k=varlen.max_len, softmax_scale=scale, causal=causal, **_window_args(window))
        res = self.vfwd(**self._bind(self.vfwd_sig, vals, self.label))
        return res[0], res[self.lse_index]

    def backward_varlen(self, dout, q, k, v, out, lse, dq, dk, dv, varlen: Varlen, causal: bool, scale: float,
                        deterministic: bool, window=None):
        vals = dict(_FIXED, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                    cu_seqlens_q=varlen.cu, cu_seqlens_k=varlen.cu, max_seqlen_q=varlen.max_len,
                    max_seqlen_k=varlen.max_len, softmax_scale=scale, causal=causal, is_causal=causal,
                    deterministic=deterministic, **_window_args(window))
        self.vbwd(**self._bind(self.vbwd_sig, vals, self.label))


def _hd(q, v) -> int:
    """The head dim FA3's backward rules read: ``max(d, dv)`` (MLA)."""
    return max(q.shape[-1], v.shape[-1])


def _window_args(window) -> Dict:
    """The window in every form's spelling (a tuple before 2.7 and in early FA3, two ints after)."""
    if window is None:
        return {}
    return dict(window_size=tuple(window), window_size_left=window[0], window_size_right=window[1])


#: values for the parameters every form may declare (None: an absent optional tensor / length)
_FIXED = dict(
    dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
    alibi_slopes=None, return_softmax=False, rng_state=None, deterministic=False, sm_margin=0,
    attention_chunk=0, sink_token_length=0, rotary_interleaved=True, num_splits=1, pack_gqa=None,
    scheduler_metadata=None, gqa_parallel=False, k_new=None, v_new=None, qv=None, out=None, out_=None,
    cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
    sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
    kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
    q_descale=None, k_descale=None, v_descale=None, descale_q=None, descale_k=None, descale_v=None,
    block_table=None, zero_tensors=False,
)
# the tensors and flags of each call are filled in per call
for _name in ("q", "k", "v", "dout", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal", "is_causal"):
    _FIXED.setdefault(_name, None)


def _fa3_surface() -> _Surface:
    mod = _fa3()
    params = _signature(mod._flash_attn_forward).parameters
    first_form = "k_new" not in params  # 2024-07 .. 2024-12: returns (out, q, k, v, out_padded, lse, S_dmask)
    bwd_params = _signature(mod._flash_attn_backward).parameters
    # hopper/flash_api.cpp (since 2025-09-17): "Deterministic backward not supported for hdim 256", i.e.
    # head dims rounded up to 256 (193..256); refused for every FA3 build (their Python surface is the same)
    s = _Surface("flash-attn 3", mod, 9 if first_form else 8, 5 if first_form else 1, "deterministic" in bwd_params,
                 det_head_dim=192)
    s.check_known()
    return s


def _fa2_surface() -> _Surface:
    mod, version = _fa2()
    v = _version_tuple(version)
    if v < (2, 6):
        raise ValueError(f"flash-attn {version} is older than 2.6, which the flash kernel needs; "
                         "upgrade it")
    six = v < (2, 7)  # 2.6.x: 8-tuple forward with the lse at index 5
    s = _Surface(f"flash-attn {version}", mod, 8, 5 if six else 1, True)
    if six != ("window_size" in s.fwd_sig.parameters):
        raise ValueError(f"flash-attn {version}'s _flash_attn_forward{s.fwd_sig} is not the {version[:3]} call form; "
                         "reinstall flash-attn")
    s.check_known()
    return s


class FlashKernel(BlockKernel):
    name = "flash"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = bool(deterministic)
        self._surfaces, errors = [], []
        for make in (_fa3_surface, _fa2_surface):
            try:
                self._surfaces.append(make())
            except ImportError:
                continue
            except ValueError as exc:
                errors.append(str(exc))
        if not self._surfaces:
            raise ValueError("; ".join(errors) or "flash-attn is not importable")
        self.version = 3 if self._surfaces[0].label == "flash-attn 3" else 2
        self._by_device: Dict[Tuple, _Surface] = {}
        self._grads: "OrderedDict[Tuple, Tuple[torch.Tensor, ...]]" = OrderedDict()  # (q, k, v) shapes -> dq, dk, dv

    @classmethod
    def available(cls) -> bool:
        try:
            flash_version()
        except Exception:
            return False
        return torch.cuda.is_available()

    def _surface(self, device, head_dim: int) -> _Surface:
        """FA3 where its build runs on this GPU (and offers determinism for this head dim if asked), else FA2."""
        cap = torch.cuda.get_device_capability(device)
        key = (cap, head_dim)
        if key not in self._by_device:
            ok = [s for s in self._surfaces if cap[0] >= s.min_sm and (s.deterministic_for(head_dim) or not self.deterministic)]
            self._by_device[key] = ok[0] if ok else self._surfaces[-1]
        return self._by_device[key]

    def _varlen_surface(self, device, head_dim: int) -> Optional[_Surface]:
        """The first build (FA3, then FA2) that runs here and has usable varlen entry points."""
        cap = torch.cuda.get_device_capability(device)
        ok = [s for s in self._surfaces if s.varlen_error is None and cap[0] >= s.min_sm
              and (s.deterministic_for(head_dim) or not self.deterministic)]
        return ok[0] if ok else None

    def check_varlen(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None) -> None:
        s = self._varlen_surface(q.device, q.shape[-1] if v is None else _hd(q, v))
        if s is None:
            why = "; ".join(x.varlen_error or f"{x.label} cannot run here" for x in self._surfaces)
            raise ValueError(f"the flash kernel cannot run packed sequences (THD) here: {why}; "
                             "install flash-attn >= 2.6")
        if v is not None and v.shape[-1] != q.shape[-1] and not (s.label == "flash-attn 3" and s.min_sm == 8):
            raise ValueError(f"the flash kernel runs packed sequences (THD) here with {s.label}, which takes one head "
                             f"dim, not MLA's {q.shape[-1]}/{v.shape[-1]}")
        check_cuda_half(f"the flash kernel ({s.label}, varlen)", q, s.min_sm)

    def check(self, q: torch.Tensor, k: torch.Tensor, v=None) -> None:
        d = q.shape[-1]
        dv = d if v is None else v.shape[-1]
        s = self._surface(q.device, max(d, dv))
        if dv != d:
            # FA3 (hopper/flash_api.cpp: forward since 2025-02-03, backward since 2025-04-24) takes a value
            # head dim of its own on Hopper only, in the forward's ranges, and its backward needs max(d, dv) <= 256;
            # FA2 and the first FA3 form take one head dim
            fa3 = s.label == "flash-attn 3" and s.min_sm == 8
            ranges = 128 < d <= 192 and 96 < dv <= 128 or d <= 64 and dv <= 256
            if not fa3 or not ranges or dv % 8:
                raise ValueError(f"{s.label} cannot run a value head dim {dv} with query/key head dim {d} (MLA; FA3 "
                                 "trains 128 < d <= 192 with 96 < dv <= 128, or d <= 64 with dv <= 256)")
            major, minor = torch.cuda.get_device_capability(q.device)
            if major != 9:
                raise ValueError(f"flash-attn 3 runs a value head dim of its own (MLA, {d}/{dv}) on Hopper (sm90) only, "
                                 f"not sm{major}{minor}")
        if self.deterministic and not s.deterministic_for(max(d, dv)):
            if s.deterministic_ok:  # FA3: hopper/flash_api.cpp refuses a deterministic backward for hdim 256
                raise ValueError(f"{s.label} has no deterministic backward for head dim {max(d, dv)} (> {s.det_head_dim}; "
                                 "hopper/flash_api.cpp refuses head dims rounded up to 256); install flash-attn 2, "
                                 "or drop deterministic mode")
            raise ValueError(f"{s.label} has no deterministic backward; drop deterministic mode")
        check_cuda_half(f"the flash kernel ({s.label})", q, s.min_sm,
                        "; install flash-attn 2" if s.label == "flash-attn 3" else "")

    def forward(self, q, k, v, *, causal: bool, scale: float, varlen: Optional[Varlen] = None, window=None):
        check_square(q, k, causal)
        if varlen is not None:  # batch 1: [t, 1, h, d] views -> [t, h, d]
            o, lse = self._varlen_surface(q.device, _hd(q, v)).forward_varlen(q[:, 0], k[:, 0], v[:, 0], varlen,
                                                                                causal, scale, window)
            return o.unsqueeze(1), lse.unsqueeze(0)
        s = self._surface(q.device, _hd(q, v))
        out = None
        if s.takes_out:  # sequence-major; FA3 writes through the view (MLA: the value head dim)
            out = torch.empty_like(q) if v.shape[-1] == q.shape[-1] else q.new_empty(q.shape[:-1] + v.shape[-1:])
        o, lse = s.forward(_bshd(q), _bshd(k), _bshd(v), causal, scale, None if out is None else _bshd(out), window)
        return (out if out is not None else _bshd(o)), lse

    def lse_for_backward(self, lse_sbh: torch.Tensor, varlen: Optional[Varlen] = None):
        if varlen is not None:
            return lse_sbh[:, 0].T.contiguous()  # [h, t]
        return lse_sbh.permute(1, 2, 0).contiguous()  # [b, h, s]

    def _buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """dq/dk/dv output buffers, sequence-major like q/k/v, reused for blocks of the same shapes.
        Only the :data:`GRAD_SHAPES` most recently used shapes are kept: with documents the
        sub-blocks' shapes change every batch (and differ per rank), and a buffer per shape ever seen
        would grow until one rank runs out of memory mid-plan while its peers wait in P2P. An evicted
        buffer goes back to the caching allocator; the results are consumed (added into the
        partials) before the next call, so reuse never aliases a live result."""
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, str(q.device))
        bufs = self._grads.get(key)
        if bufs is None:
            bufs = self._grads[key] = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
            while len(self._grads) > GRAD_SHAPES:
                self._grads.popitem(last=False)
        else:
            self._grads.move_to_end(key)
        return bufs

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, varlen: Optional[Varlen] = None,
                 window=None):
        check_square(q, k, causal)
        dq, dk, dv = self._buffers(q, k, v)
        if varlen is not None:
            self._varlen_surface(q.device, _hd(q, v)).backward_varlen(
                dout[:, 0], q[:, 0], k[:, 0], v[:, 0], out[:, 0], lse, dq[:, 0], dk[:, 0], dv[:, 0], varlen, causal,
                scale, self.deterministic, window)
            return dq, dk, dv
        self._surface(q.device, _hd(q, v)).backward(_bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse,
                                                      _bshd(dq), _bshd(dk), _bshd(dv), causal, scale,
                                                      self.deterministic, window)
        return dq, dk, dv

"""The runtime: what runs on every rank during training.

Mesh topology and token layout, the plan language (ops a schedule is made of) and its validator,
the liveness layout of a plan's buffers, the executor and its communicators, the per-block kernels,
the (out, lse) merge, the Ulysses all-to-all of ``a2a+mesh``, the cross-rank agreement check and
the process groups. Nothing here imports the planning layer or Megatron.
"""

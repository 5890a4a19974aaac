"""Megatron-LM integration: core attention, layer specs, arguments, launcher, CPU compatibility.

Importing this package needs megatron-core (``pip install megatron-mesh-cp[megatron]``); the rest
of megatron_mesh_cp does not.
"""

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "megatron_mesh_cp.megatron needs megatron-core; install it with pip install 'megatron-mesh-cp[megatron]'"
    ) from exc

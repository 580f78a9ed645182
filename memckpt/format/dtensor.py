"""DTensor (FSDP2, tensor parallel) support for state capture: local chunks + layout metadata.

A snapshot holds each rank's *local* tensor of a DTensor (``to_local()``: an alias of
the live storage, no gather, no collective) and, per tensor, the JSON record
:func:`chunk_meta` returns: global shape, the global offset of the local chunk per
dimension, the mesh shape and names, and the placements as ``str(p)``. A tensor
without a record is plain: its global shape is its local shape, offsets all 0.

``torch.distributed.tensor`` is never imported here: a DTensor can only exist once
its module is loaded, so :func:`is_dtensor` asks ``sys.modules`` (importing it costs
~0.5 s and some torch builds lack it).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

import torch

from memckpt.errors import StateError

_MODULE = "torch.distributed.tensor"


def is_dtensor(t: Any) -> bool:
    mod = sys.modules.get(_MODULE)
    return mod is not None and isinstance(t, mod.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind ``t`` (``t`` itself when plain); aliases live storage."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():  # with grad enabled to_local() is an autograd op, not the alias
        return t.to_local()  # type: ignore[attr-defined]  # is_dtensor(t) holds


def chunk_meta(t: Any) -> dict[str, Any]:
    """The JSON record of DTensor ``t``'s local chunk (memoised per mesh, this rank's place
    in it, placements, shape)."""
    return _chunk(t.device_mesh, tuple(t.placements), tuple(t.shape))[0]


def _chunk(mesh: Any, placements: tuple, global_shape: tuple[int, ...]
           ) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(record, local shape) on this rank; torch's own arithmetic, uneven shards included."""
    # Keyed by the rank's coordinate too: meshes of the same shape compare equal, and a
    # process reused as another rank (a survivor after a resize, a kept worker) would
    # otherwise get the offsets of the rank it was before.
    coordinate = mesh.get_coordinate()
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    return _chunk_at(mesh, tuple(coordinate) if coordinate is not None else None, rank,
                     placements, global_shape)


@functools.lru_cache(maxsize=4096)
def _chunk_at(mesh: Any, coordinate: Optional[tuple[int, ...]], rank: Optional[int],
              placements: tuple, global_shape: tuple[int, ...]
              ) -> tuple[dict[str, Any], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if rank is not None and coordinate is not None and (placed := int(mesh.mesh[coordinate])) != rank:
        # torch computed this tensor's spec in an earlier process group (see forget_meshes):
        # its offsets would be another rank's, recorded as this one's
        raise StateError(
            f"a DTensor's DeviceMesh places this process at {list(coordinate)}, rank "
            f"{placed}'s place, but it is rank {rank}: the mesh belongs to an "
            "earlier process group of this process (torch caches DTensor specs across groups). "
            "Call memckpt.format.dtensor.forget_meshes() in a process that joins a new group, "
            "before it builds the model (memckpt's workers do)")
    shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    names = mesh.mesh_dim_names
    record = {"global_shape": list(global_shape), "offsets": [int(o) for o in offsets],
              "mesh_shape": list(mesh.shape), "mesh_dim_names": list(names) if names else None,
              "placements": [str(p) for p in placements]}
    return record, tuple(int(n) for n in shape)


def forget_meshes() -> None:
    """Drop what torch (and this module) cached about the DeviceMeshes of earlier process
    groups. For a process that joins a new group (a survivor of a resize, a kept worker),
    before it builds the new group's model (before or after ``init_process_group``).

    DTensor's sharding propagation caches each op's output spec by its input specs, and a
    mesh of the new group compares equal to the old group's mesh of the same shape. So a
    parameter FSDP2 makes in the new group (``nn.Parameter`` of a DTensor runs a cached
    ``detach``) would carry the old mesh object: the old rank's coordinate (its chunk
    offsets, in a snapshot and in DCP's metadata) and the old group's destroyed process
    groups (any collective a DTensor op issues)."""
    _chunk_at.cache_clear()
    if _MODULE not in sys.modules:
        return  # nothing was cached: no DTensor was ever made here
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:  # the C++ fast path's cache (private: absent from some torch)
        clear()
    propagator = sys.modules[_MODULE].DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        getattr(getattr(propagator, name, None), "cache_clear", lambda: None)()


def like(name: str, saved: Optional[dict[str, Any]], chunk: torch.Tensor, live: Any) -> torch.Tensor:
    """``chunk`` (a snapshot's local tensor named ``name``, with layout record ``saved`` or
    None when it was plain) as the live state holds it: a DTensor on ``live``'s mesh and
    placements, on its device, when ``live`` is one; ``chunk`` itself when both are plain.
    ``live`` is the tensor it replaces, or the parameter an optimizer state belongs to.
    Raises :class:`StateError` when the layouts differ (that needs a resharding load)."""
    if saved is None:
        if is_dtensor(live):
            raise _layout_error(name, "it was saved as a plain tensor, the live one is a "
                                f"DTensor ({_describe(chunk_meta(live))})")
        return chunk
    if not is_dtensor(live):
        raise _layout_error(name, f"it was saved as a DTensor ({_describe(saved)}), the live "
                            "one is a plain tensor")
    from torch.distributed.tensor import DTensor
    mesh, placements = live.device_mesh, tuple(live.placements)
    shape = tuple(int(n) for n in saved.get("global_shape", ()))
    now, local_shape = _chunk(mesh, placements, shape)
    keys = ("global_shape", "offsets", "mesh_shape", "placements")
    if any(saved.get(k) != now[k] for k in keys) or tuple(chunk.shape) != local_shape:
        raise _layout_error(name, f"it was saved as {_describe(saved)}, this rank holds "
                            f"{_describe(now)}")
    return DTensor.from_local(chunk.to(local(live).device), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous(shape))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _describe(m: dict[str, Any]) -> str:
    return (f"shape {m.get('global_shape')} on mesh {m.get('mesh_shape')} with placements "
            f"{m.get('placements')} at offsets {m.get('offsets')}")


def _layout_error(name: str, why: str) -> StateError:
    return StateError(f"tensor {name!r} does not fit this process's layout: {why}. A same-layout "
                      "restore copies each rank's local chunk; a snapshot of another layout "
                      "(world size, mesh or placements) needs a resharding load")


def world() -> tuple[int, int]:
    """(world_size, rank) of the default process group; (1, 0) without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0

"""Exact training-state capture: live objects <-> named tensors + JSON metadata.

:class:`TrainState` gathers models, optimizers, LR schedulers, a GradScaler, data
positions, RNG streams and JSON-able extras. ``capture()`` returns the tensors
(aliases of live storage, no copy) and a small JSON skeleton; ``load()`` puts
them back so training continues bit-identically. Optimizer state is keyed by
parameter *name*, so a reordered parameter list restores correctly; tied
weights are stored once. Nothing here knows about Ray or storage.
"""

from __future__ import annotations

import json
import operator
import random
from collections import ChainMap
from itertools import chain
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import torch

from memckpt.format import dtensor as dt
from memckpt.format import shard as fmt
from memckpt.config import CONTENT_KINDS
from memckpt.errors import StateError

_MARKERS = ("__tensor__", "__tuple__", "__items__", "__ndarray__")
OPTIMIZER_PREFIX = "optim/"  # names of optimizer tensors in a shard: optim/<optimizer>/...


@dataclass
class Captured:
    """Named tensors (live aliases) plus the JSON metadata to rebuild the state.

    A DTensor is captured as its rank-local tensor; ``meta["dtensors"]`` maps its name
    to :func:`memckpt.format.dtensor.chunk_meta` (global shape, offsets of the local chunk,
    mesh, placements). ``meta["world_size"]`` and ``meta["rank"]`` say who wrote it.

    ``stable`` names tensors that only ``optimizer.step()`` mutates (parameters and
    optimizer state): an overlapped snapshot may copy them while the next forward
    and backward run. Every other tensor must be copied before the step goes on.
    """

    tensors: list[tuple[str, torch.Tensor]]
    stable: frozenset[str]
    meta: dict[str, Any]
    # parameters that do not train (requires_grad=False: a LoRA job's base): what
    # EngineConfig.skip_unchanged="trust" takes as unchanged on its version counter alone
    frozen: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


def _named(kind: str, obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        for k in obj:
            if not isinstance(k, str) or not k or "/" in k:
                raise StateError(f"{kind} names must be non-empty strings without '/'; got {k!r}")
        return dict(obj)
    return {kind: obj}


def _short(names: Iterable[str], limit: int = 10) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


_SCALARS = frozenset({bool, int, float, str, type(None)})  # exact types: JSON as they are


class _Flattener:
    """Splits a nested state_dict into JSON plus tensors (never pickle)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]],
                 dtensors: Optional[dict[str, Any]] = None) -> None:
        self.tensors = tensors
        self.dtensors = {} if dtensors is None else dtensors

    def __call__(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append((path, _local_alias(obj, path, self.dtensors)))
            return {"__tensor__": path}
        if isinstance(obj, np.ndarray):
            # ascontiguousarray makes a 0-d array 1-d: keep the shape
            arr = np.ascontiguousarray(obj).reshape(obj.shape)
            self.tensors.append((path, torch.from_numpy(arr).clone()))
            return {"__ndarray__": path}
        if isinstance(obj, (bool, int, float, str)) or obj is None:
            return obj
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, (tuple, list)):
            # A run of plain scalars (an RNG state: ~1250 ints captured every step) is JSON
            # as it is: no call and no path string per element.
            items = list(obj) if _SCALARS.issuperset(map(type, obj)) else \
                [self(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return {"__tuple__": items} if isinstance(obj, tuple) else items
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) for k in obj):
                clash = [k for k in obj if k in _MARKERS]
                if clash:
                    raise StateError(f"{path}: key {clash[0]!r} is reserved by memckpt")
                return {k: self(v, f"{path}/{k}") for k, v in obj.items()}
            return {"__items__": [[self(k, f"{path}/k{i}"), self(v, f"{path}/{i}")]
                                  for i, (k, v) in enumerate(obj.items())]}
        raise StateError(f"cannot capture {type(obj).__name__} at {path!r}: state may hold only "
                         "tensors, numpy arrays, numbers, strings, lists, tuples and dicts")


@dataclass(frozen=True)
class LoadMemory:
    """Where a load's bytes land. ``before_copy`` sees the live model tensors a load is
    about to overwrite; ``clone`` copies a snapshot tensor into new memory (the optimizer
    state a load creates). The defaults do nothing more than that; the restore paths pass
    :data:`memckpt.engine.populate.FAULTED_IN`, which faults the memory in before the copy."""

    before_copy: Callable[[Iterable[torch.Tensor]], object] = lambda tensors: None
    clone: Callable[[torch.Tensor], torch.Tensor] = torch.clone
    # the optimizer state's, when it differs (a GPU restore hands torch the pinned views to
    # copy to the device itself, with no host clone between)
    optimizer_clone: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def _local_alias(t: torch.Tensor, name: str, dtensors: dict[str, Any]) -> torch.Tensor:
    """``t`` detached; a DTensor becomes its local tensor, its layout recorded under ``name``
    (detached after ``to_local``: a DTensor's own detach costs a dispatch per tensor)."""
    if dt.is_dtensor(t):
        dtensors[name] = dt.chunk_meta(t)
        return dt.local(t).detach()
    return t.detach()


Wrap = Callable[[str, torch.Tensor], torch.Tensor]


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _unflatten(obj: Any, tensors: Mapping[str, torch.Tensor],
               clone: Callable[[torch.Tensor], torch.Tensor] = torch.clone,
               wrap: Optional[Wrap] = None) -> Any:
    """Inverse of :class:`_Flattener`; tensors are cloned so no state aliases a buffer.
    ``wrap(name, clone)`` turns a clone back into what the live state holds (a DTensor)."""
    if isinstance(obj, list):
        return [_unflatten(v, tensors, clone, wrap) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            name = obj["__tensor__"]
            out = clone(_tensor(tensors, name))
            return wrap(name, out) if wrap is not None else out
        if "__ndarray__" in obj:
            return _tensor(tensors, obj["__ndarray__"]).numpy().copy()
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors, clone, wrap) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {_unflatten(k, tensors, clone, wrap): _unflatten(v, tensors, clone, wrap)
                    for k, v in obj["__items__"]}
        return {k: _unflatten(v, tensors, clone, wrap) for k, v in obj.items()}
    return obj


def unflatten(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """A captured JSON skeleton back to Python values (tuples, dicts with non-string
    keys), its tensors taken from ``tensors`` by name (cloned)."""
    return _unflatten(obj, tensors)


def _tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise StateError(f"snapshot is missing tensor {name!r}") from None


def _storage_key(t: torch.Tensor) -> tuple:
    """Where ``t``'s bytes are (a plain or local tensor): equal keys are one tied weight."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def _plain(m: torch.nn.Module) -> bool:
    """``m``'s state_dict is what its parameter, buffer and submodule dicts hold: no override,
    extra state or hook adds to it or acts on its own."""
    cls, base = type(m), torch.nn.Module
    return (cls.state_dict is base.state_dict and cls._save_to_state_dict is base._save_to_state_dict
            and getattr(cls, "get_extra_state", base.get_extra_state) is base.get_extra_state
            and not m._state_dict_hooks and not m._state_dict_pre_hooks
            and not {"state_dict", "_save_to_state_dict", "get_extra_state"} & m.__dict__.keys())


def _reusable(t: torch.Tensor) -> bool:
    """A plain strided tensor on a device ``is_set_to`` runs on (not meta)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided \
        and t.device.type in ("cpu", "cuda")


# what a module's state_dict is made of, read from its __dict__ in one C call
_containers = operator.itemgetter("_parameters", "_buffers", "_modules",
                                  "_non_persistent_buffers_set", "_state_dict_hooks",
                                  "_state_dict_pre_hooks")


class _ModelsPart:
    """The models' share of a capture (their state_dict's tensors as detached aliases, a tied
    weight once), kept from one capture to the next while :meth:`holds`: a few C-level passes
    over modules and tensors instead of walking each model's state_dict and detaching again.

    It holds while every module has the same class and the same parameter, buffer and
    submodule dicts mapping the same names to the same objects (no more, no fewer), the
    same non-persistent buffer names and no state_dict hook; and every tensor's alias still
    is it (``is_set_to``: storage, offset, shape, strides; and its dtype and
    ``requires_grad`` are the same). A swapped, added or removed parameter, buffer or module,
    ``p.data = ...`` or ``requires_grad_()`` makes the next capture walk again; models whose
    state_dict is not their dicts' (:func:`_plain`), or with DTensors, are walked every time."""

    def __init__(self, models: Mapping[str, torch.nn.Module]) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.stable: set[str] = set()
        self.dtensors: dict[str, Any] = {}
        self.aliases: dict[str, str] = {}
        self.keys: dict[str, list[str]] = {}
        self.live: list[torch.Tensor] = []
        self.local: list[torch.Tensor] = []  # each live tensor's alias (tied ones' too)
        frozen: set[str] = set()
        seen: dict[tuple, str] = {}
        for mname, m in models.items():
            params = {fqn for fqn, _ in m.named_parameters(remove_duplicate=False)}
            keys = self.keys[mname] = []
            for key, t in m.state_dict(keep_vars=True).items():  # detached below, cheaper
                name = f"model/{mname}/{key}"
                keys.append(key)
                if key in params and not t.requires_grad:
                    frozen.add(name)
                alias = _local_alias(t, name, self.dtensors)
                self.live.append(t)
                self.local.append(alias)
                skey = _storage_key(alias)
                if skey in seen and alias.numel():  # tied weight: store once, remember the alias
                    self.aliases[name] = seen[skey]
                    self.dtensors.pop(name, None)  # the alias's target holds the layout
                    continue
                seen[skey] = name
                self.tensors.append((name, alias))
                if key in params:
                    self.stable.add(name)
        self.frozen = frozenset(frozen)
        self.param_names: dict[int, str] = {}
        for mname, m in models.items():
            for fqn, p in m.named_parameters():
                self.param_names.setdefault(id(p), f"{mname}/{fqn}")
        self.mods = list(dict.fromkeys(x for m in models.values() for x in m.modules()))
        self.reusable = (not self.dtensors and all(map(_plain, self.mods))
                         and all(map(_reusable, self.live)))
        try:  # what holds() compares
            self.reusable = self.reusable and self._signature()
        except KeyError:  # a module without the usual dicts
            self.reusable = False

    def _signature(self) -> bool:
        self.types = list(map(type, self.mods))
        self.vars = [x.__dict__ for x in self.mods]
        self.conts = [c for x in self.vars for c in _containers(x)]
        self.lens = list(map(len, self.conts))
        self.sets = [x._non_persistent_buffers_set for x in self.mods]
        self.set_copies = [frozenset(s) for s in self.sets]
        links = [(d, k, v) for x in self.mods  # every (dict, name, object) of every module
                 for d in (x._parameters, x._buffers, x._modules) for k, v in d.items()]
        self.dicts: list[dict[str, Any]] = [d for d, _, _ in links]
        self.names: list[str] = [k for _, k, _ in links]
        self.values: list[Any] = [v for _, _, v in links]
        self.grads = [t.requires_grad for t in self.live]
        self.dtypes = [t.dtype for t in self.live]
        return True

    def holds(self) -> bool:
        """Whether the models' state_dict is still what this part captured (see the class)."""
        try:
            return self.reusable and self._holds()
        except (RuntimeError, TypeError, KeyError):  # a meta tensor (no is_set_to), ...
            return False

    def _holds(self) -> bool:
        return (list(map(type, self.mods)) == self.types
                and all(map(operator.is_, chain.from_iterable(map(_containers, self.vars)),
                            self.conts))
                and list(map(len, self.conts)) == self.lens
                and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.values))
                and all(map(operator.eq, self.sets, self.set_copies))
                and [t.requires_grad for t in self.live] == self.grads
                and [t.dtype for t in self.live] == self.dtypes
                and all(map(torch.Tensor.is_set_to, self.live, self.local)))


@dataclass
class TrainState:
    """Everything that must come back for a run to continue bit-identically.

    Each of ``model``, ``optimizer``, ``scheduler`` and ``data`` is one object or a
    dict of named objects. ``data`` objects need ``state_dict``/``load_state_dict``
    (a sampler, a dataset cursor; see :class:`memckpt.ResumableSampler`).
    ``extras`` is a JSON-able dict the training loop may change; a restore
    replaces its contents in place.
    """

    model: Any
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    data: Any = None
    rng: bool = True
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.models = _named("model", self.model)
        if not self.models:
            raise StateError("TrainState needs at least one model")
        for name, m in self.models.items():
            if not isinstance(m, torch.nn.Module):
                raise StateError(f"model {name!r} is a {type(m).__name__}, not a torch.nn.Module")
        self.optimizers = _named("optimizer", self.optimizer)
        self.schedulers = _named("scheduler", self.scheduler)
        self.datas = _named("data", self.data)
        for name, d in self.datas.items():
            if not (hasattr(d, "state_dict") and hasattr(d, "load_state_dict")):
                raise StateError(f"data {name!r} ({type(d).__name__}) needs state_dict() and "
                                 "load_state_dict(); wrap it or use memckpt.ResumableSampler")
        if not isinstance(self.extras, dict):
            raise StateError("extras must be a dict of JSON-able values")
        self._models_part: Optional[_ModelsPart] = None  # the last capture's, while it holds

    # -- parameter names -----------------------------------------------------------------
    def _param_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for mname, m in self.models.items():
            for fqn, p in m.named_parameters():
                names.setdefault(id(p), f"{mname}/{fqn}")
        return names

    def _optimizer_names(self, oname: str, opt: torch.optim.Optimizer,
                         names: dict[int, str]) -> list[list[str]]:
        groups = []
        for group in opt.param_groups:
            pnames = []
            for p in group["params"]:
                if id(p) not in names:
                    raise StateError(f"optimizer {oname!r} holds a parameter of shape {tuple(p.shape)} "
                                     "that belongs to no model in the TrainState: pass its model too")
                pnames.append(names[id(p)])
            groups.append(pnames)
        return groups

    def named_params(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter by its name in a shard: ``<model name>/<fqn>``."""
        return {f"{mname}/{fqn}": p for mname, m in self.models.items()
                for fqn, p in m.named_parameters()}

    def local_optimizer(self, oname: str) -> torch.optim.Optimizer:
        """The optimizer holding this rank's state (for ZeRO its shard's optimizer)."""
        return _local_optimizer(self.optimizers[oname])

    def optimizer_params(self, oname: str) -> list[list[str]]:
        """Names of the parameters in each group of optimizer ``oname``'s local optimizer
        (for ZeRO, the parameters this rank owns)."""
        return self._optimizer_names(oname, self.local_optimizer(oname), self._param_names())

    # -- capture ---------------------------------------------------------------------------
    def capture(self, step: int) -> Captured:
        """Named live tensors and metadata for ``step``. Copies nothing large."""
        world_size, rank = dt.world()
        part = self._models_part
        if part is None or not part.holds():
            part = self._models_part = _ModelsPart(self.models)
        tensors = list(part.tensors)
        stable = set(part.stable)
        dtensors = dict(part.dtensors)
        meta: dict[str, Any] = {"step": step, "world_size": world_size, "rank": rank,
                                "models": {k: list(v) for k, v in part.keys.items()},
                                "aliases": dict(part.aliases), "dtensors": dtensors}
        flat = _Flattener(tensors, dtensors)
        names = part.param_names
        meta["optimizers"] = {}
        for oname, wrapper in self.optimizers.items():
            opt = _local_optimizer(wrapper)
            groups = self._optimizer_names(oname, opt, names)
            sd = opt.state_dict()
            if opt is not wrapper:  # ZeRO: the wrapper's groups hold the current hyperparameters
                for group, outer in zip(sd["param_groups"], wrapper.param_groups):
                    group.update({k: v for k, v in outer.items() if k != "params"})
            flat_names = [n for g in groups for n in g]
            state_meta = {}
            for idx, st in sd["state"].items():
                pname = flat_names[idx]
                before = len(tensors)
                state_meta[pname] = flat(st, f"{OPTIMIZER_PREFIX}{oname}/{pname}")
                stable.update(n for n, _ in tensors[before:])
            pgroups = [dict({k: flat(v, f"{OPTIMIZER_PREFIX}{oname}/group{i}/{k}")
                             for k, v in g.items() if k != "params"}, params=groups[i])
                       for i, g in enumerate(sd["param_groups"])]
            meta["optimizers"][oname] = {"state": state_meta, "param_groups": pgroups}
        meta["schedulers"] = {n: flat(s.state_dict(), f"sched/{n}") for n, s in self.schedulers.items()}
        meta["scaler"] = flat(self.scaler.state_dict(), "scaler") if self.scaler is not None else None
        meta["data"] = {n: flat(d.state_dict(), f"data/{n}") for n, d in self.datas.items()}
        if self.rng:
            meta["rng"] = flat(rng_state(), "rng")
        try:
            meta["extras"] = json.loads(json.dumps(self.extras))
        except (TypeError, ValueError) as e:
            raise StateError(f"extras must be JSON-able: {e}") from None
        return Captured(tensors, frozenset(stable), meta, part.frozen)

    # -- load ------------------------------------------------------------------------------
    def load(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
             content: Optional[Iterable[str]] = None, memory: LoadMemory = LoadMemory(), *,
             clone: bool = True) -> int:
        """Put a snapshot's state back into the live objects; returns its step.

        ``content`` limits what is loaded (kinds from ``memckpt.config.CONTENT_KINDS``;
        None loads everything); ``memory`` says how new memory is prepared. Missing or unexpected
        entries raise
        :class:`StateError` naming them; nothing is half-loaded for a model
        whose keys do not match. ``clone=False`` takes the optimizer state tensors as
        they are instead of copying them (tensors made for this load, owned by nobody else).
        """
        kinds = set(CONTENT_KINDS if content is None else content)
        dtensors: Mapping[str, Any] = meta.get("dtensors", {})
        # not copied into a dict: a mapping that verifies each tensor on first look-up
        # (memckpt.engine.restore) loads the tensors verified so far while the rest verify
        tensors = ChainMap({alias: _tensor(tensors, target)
                            for alias, target in meta.get("aliases", {}).items()},
                           tensors)  # type: ignore[arg-type]  # only read: ChainMap writes to its first map
        if "model" in kinds:
            self._check_names("model", meta["models"], self.models)
            for mname, m in self.models.items():
                live = m.state_dict()
                want = set(live)
                have = set(meta["models"][mname])
                if want != have:
                    raise StateError(f"model {mname!r} does not match the snapshot: missing keys: "
                                     f"[{_short(want - have)}]; unexpected keys: [{_short(have - want)}]")
                entries = {}
                for k in have:
                    name = f"model/{mname}/{k}"
                    record = dtensors.get(meta.get("aliases", {}).get(name, name))
                    entries[k] = dt.like(name, record, _tensor(tensors, name), live[k])
                memory.before_copy([dt.local(t) for t in live.values()])  # no faults in the copy
                m.load_state_dict(entries)
        if "optimizer" in kinds:
            self._check_names("optimizer", meta["optimizers"], self.optimizers)
            names = self._param_names()
            for oname, opt in self.optimizers.items():
                local = _local_optimizer(opt)
                self._load_optimizer(oname, local, meta["optimizers"][oname], tensors, names,
                                     (memory.optimizer_clone or memory.clone) if clone
                                     else _as_is, dtensors)
                if local is not opt:  # ZeRO: its own groups feed the shard's at every step
                    for outer, inner in zip(opt.param_groups, local.param_groups):
                        outer.update({k: v for k, v in inner.items() if k != "params"})
        if "scheduler" in kinds:
            self._check_names("scheduler", meta["schedulers"], self.schedulers)
            for n, s in self.schedulers.items():
                s.load_state_dict(_unflatten(meta["schedulers"][n], tensors, memory.clone))
        if "scaler" in kinds and self.scaler is not None:
            if meta.get("scaler") is None:
                raise StateError("the snapshot has no GradScaler state but the TrainState has a scaler")
            self.scaler.load_state_dict(_unflatten(meta["scaler"], tensors, memory.clone))
        if "data" in kinds:
            self._check_names("data", meta["data"], self.datas)
            for n, d in self.datas.items():
                d.load_state_dict(_unflatten(meta["data"][n], tensors, memory.clone))
        if "rng" in kinds and self.rng and meta.get("rng") is not None:
            set_rng_state(_unflatten(meta["rng"], tensors, memory.clone))
        if "extras" in kinds:
            self.extras.clear()
            self.extras.update(meta.get("extras", {}))
        return int(meta["step"])

    @staticmethod
    def _check_names(kind: str, stored: Mapping[str, Any], live: Mapping[str, Any]) -> None:
        if set(stored) != set(live):
            raise StateError(
                f"{kind} names differ: the snapshot has [{_short(stored)}], the TrainState has "
                f"[{_short(live)}]; pass the same {kind}s, or leave {kind!r} out of load.content")

    def _load_optimizer(self, oname: str, opt: torch.optim.Optimizer, saved: Mapping[str, Any],
                        tensors: Mapping[str, torch.Tensor], names: dict[int, str],
                        clone: Callable[[torch.Tensor], torch.Tensor],
                        dtensors: Mapping[str, Any]) -> None:
        current = self._optimizer_names(oname, opt, names)
        stored_groups = saved["param_groups"]
        if len(stored_groups) != len(current):
            raise StateError(f"optimizer {oname!r} has {len(current)} param groups, the snapshot "
                             f"has {len(stored_groups)}")
        # Groups are matched by the names they hold, so a reordered group list restores
        # each group's hyperparameters to the group with the same parameters.
        by_names = {frozenset(g["params"]): g for g in stored_groups}
        if len(by_names) == len(current) and all(frozenset(c) in by_names for c in current):
            stored_groups = [by_names[frozenset(c)] for c in current]
        index: dict[str, int] = {}  # parameter name -> its index in the current order
        for i, (group, cur) in enumerate(zip(stored_groups, current)):
            stored = set(group["params"])
            if stored != set(cur):
                raise StateError(
                    f"optimizer {oname!r} group {i} does not match the snapshot: missing params: "
                    f"[{_short(set(cur) - stored)}]; unexpected params: [{_short(stored - set(cur))}]")
            for pname in cur:
                index[pname] = len(index)
        # Indices follow the *current* parameter order, so torch maps each saved
        # entry onto the parameter with the same name.
        params = self.named_params()

        def as_live(pname: str) -> Wrap:
            # a state tensor saved as a DTensor takes its parameter's mesh and placements;
            # 0-d ones (step counters) stay plain; any other plain one of a DTensor
            # parameter is from another layout (like() says so)
            param = params[pname]

            def wrap(name: str, t: torch.Tensor) -> torch.Tensor:
                if name in dtensors or (t.dim() and dt.is_dtensor(param)):
                    return dt.like(name, dtensors.get(name), t, param)
                return t
            return wrap

        state = {index[p]: _unflatten(st, tensors, clone, as_live(p))
                 for p, st in saved["state"].items()}
        groups = []
        for group, cur in zip(stored_groups, current):
            g = {k: _unflatten(v, tensors, clone) for k, v in group.items() if k != "params"}
            g["params"] = [index[p] for p in cur]
            groups.append(g)
        opt.load_state_dict({"state": state, "param_groups": groups})


def same_layout(state: TrainState, header: Any) -> bool:
    """True if a shard header (a :class:`memckpt.format.dcp_reader.ShardHeader`) holds this
    rank's model tensors as the live state lays them out (same local shapes and, for
    DTensors, the same offsets): then the shard loads as it is, else it is resharded."""
    cap = state.capture(int(header.header.get("step", 0)))
    live_dt = cap.meta.get("dtensors") or {}
    for name, t in cap.tensors:
        if not name.startswith("model/"):
            continue
        e = header.entries.get(name)
        if e is None or e.shape != tuple(t.shape):
            return False
        stored_dt = (header.meta.get("dtensors") or {}).get(name)
        if (stored_dt or {}).get("offsets") != (live_dt.get(name) or {}).get("offsets"):
            return False
    return True


def restore_allocations(layout: fmt.Layout, min_bytes: int = 0
                        ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the tensors a restore of ``layout`` creates: the optimizer state
    (parameters and buffers are copied into the model's own), those of ``min_bytes`` or more."""
    dtypes = fmt.torch_dtypes()
    return [(e.shape, dtypes[e.dtype]) for e in layout.entries
            if e.name.startswith(OPTIMIZER_PREFIX) and e.nbytes >= min_bytes]


def _local_optimizer(opt: Any) -> Any:
    """The optimizer holding this rank's state: ZeroRedundancyOptimizer keeps only its
    shard in ``.optim`` (its own ``state_dict`` needs a collective consolidation)."""
    # Not imported here: importing torch.distributed.optim compiles TorchScript (~0.5 s),
    # and a ZeroRedundancyOptimizer exists only once its module is loaded.
    import sys
    mod = sys.modules.get("torch.distributed.optim")
    return opt.optim if mod is not None and isinstance(opt, mod.ZeroRedundancyOptimizer) else opt


def rng_state() -> dict[str, Any]:
    """Every global RNG stream: Python, NumPy, torch CPU and (where present) CUDA."""
    version, internal, gauss = random.getstate()
    np_state: Any = np.random.get_state()  # the legacy tuple
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

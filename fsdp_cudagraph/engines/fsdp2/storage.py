"""FSDP2's unsharded parameters at fixed addresses: every unit's kept, or a few preallocated slots shared by turns.

Two user-facing ways (both exported from ``fsdp_cudagraph``), and the readers of FSDP2's per-module state they and
the adapter (``adapter.py``) share (:func:`state_of`, :func:`param_groups`, :func:`fsdp_params`).

:func:`keep_unsharded_storage` makes FSDP2's resharding address-stable by never freeing any unit's unsharded
parameters: every unit's full parameters are held for the whole run.
:func:`use_unsharded_slots` holds ``num_slots`` (default 2) buffers instead, each sized to the largest unit,
and draws every unit's unsharded parameters from one of them, units alternating in module order (unit ``i``
in slot ``i % num_slots``), as Megatron-FSDP's double buffer does.

[Note: FSDP2 unsharded-parameter slots]
An FSDPParam's unsharded parameter is an ``as_strided`` view of its ``all_gather_outputs`` (built once, at its
first all-gather); FSDP2 frees those outputs at reshard (``free_unsharded_param``: storage resized to 0) and
re-allocates them at the next all-gather (``alloc_all_gather_outputs``), then copies the gathered shards in. Here
both methods are replaced on each FSDPParam (instance attributes shadow them): the outputs become fixed views into
the unit's slot (laid out once, parameter after parameter, each at a 256-byte aligned offset), and the unsharded
parameter is built on that view at bind time (FSDP2's own ``init_unsharded_param`` would take
``storage_offset=0``, the slot's start, and keeps a parameter it finds), so it never moves; the allocation
*claims* the slot for the unit and the free *releases* the claim, nothing is allocated or freed. FSDP2 allocates
at the copy-out of a unit's all-gather, which runs in the unit's own pre-forward / pre-backward (a prefetched
all-gather lands in FSDP2's separate communication buffer until then), so a slot is claimed from the unit's use to
its reshard; under ZeRO-3 one unit holds a slot at a time and even one slot suffices (tested). A unit whose slot
is claimed by another unit that is still unsharded (more units unsharded at once than slots:
reshard_after_forward=False, no reshard after backward) is refused with RuntimeError: its parameters would
overwrite the other's. Numerics are FSDP2's own: the same all-gather, the same copy-out, into other memory. The
slots are on the parameters' device and are laid out for FSDP2's own dtype of the gathered parameters
(``param_dtype`` under a MixedPrecisionPolicy). On a GPU the reuse is ordered by the stream: a copy-out runs on
the current stream after every kernel (or replay) that read the slot's previous holder, as FSDP2's own
free-and-reallocate relies on the caching allocator's per-stream reuse.

The root's own parameters (embeddings, head: not a unit) stay unsharded from the root's pre-forward to its
post-backward, alongside every layer, so they are kept as :func:`keep_unsharded_storage` keeps them rather than
drawn from a slot. Each unit is laid out for its own mesh's shard size: with expert parallelism the experts units
gather over the expert-data-parallel ranks; an experts unit on one such rank (``EP = W``) is kept like the root
(FSDP2 resizes a one-rank unit's outputs itself). An experts unit is unsharded inside its layer's forward and
backward; the two are consecutive in module order, so with two slots or more they hold different slots. A unit moved to another slot (:meth:`UnshardedSlots.assign`) between steps re-binds its views
and gets a new unsharded parameter at its next all-gather; once a capture has read a unit's parameters
(:meth:`UnshardedSlots.pin`, called by the FSDP2 adapter's ``prepare_capture``), moving it is refused: the graph
reads the slot it was captured with.

Not supported (refused by :func:`use_unsharded_slots`): one rank (FSDP2 then copies with ``alloc_storage``
on the outputs directly, which would resize a slot), all-gather extensions (``fsdp_pre_all_gather``) and
DTensor (tensor-parallel) parameters, whose unsharded parameters are not plain views of the outputs, and units
already under ``keep_unsharded_storage``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["keep_unsharded_storage", "release_unsharded_storage", "UnshardedSlots", "use_unsharded_slots",
           "release_unsharded_slots", "slots_of", "state_of", "param_groups", "fsdp_params", "KEEP_MARK", "SLOT_MARK"]

#: Marks an FSDPParam whose unsharded storage is a slot view (check_partial_graphs accepts it as kept).
SLOT_MARK = "_fsdp_cudagraph_slot"
#: The root module's attribute holding its UnshardedSlots (read by :func:`slots_of`).
SLOTS_ATTR = "_fsdp_cudagraph_slots"
_ALIGN = 256


def state_of(module: nn.Module):
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    return _get_module_fsdp_state(module)


KEEP_MARK = "_fsdp_cudagraph_keep_storage"


def param_groups(state) -> List[Any]:
    """The unit's param groups: ``_fsdp_param_groups`` (torch 2.13) or the one ``_fsdp_param_group`` (2.11)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    raise NotImplementedError(
        f"fsdp_cudagraph: torch {torch.__version__}'s FSDPState has neither _fsdp_param_groups (2.13) nor "
        "_fsdp_param_group (2.11), which the FSDP2 adapter reads; use torch 2.11 to 2.13 (the versions checked) "
        "or report the version")


def fsdp_params(model: nn.Module) -> List[Any]:
    seen, out = set(), []
    for m in model.modules():
        state = state_of(m)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        for g in param_groups(state):
            out.extend(g.fsdp_params)
    return out


def keep_storage(*_: Any) -> None:
    """Stands in for ``FSDPParam.free_unsharded_param``: the unsharded storage stays allocated."""


def keep_unsharded_storage(model: nn.Module) -> int:
    """Keep every FSDP2 unit's unsharded parameter storage allocated, so resharding no longer moves it.

    [Note: address-stable resharding]
    FSDP2 reshards by swapping the module's parameter back to the sharded DTensor and freeing the unsharded
    storage (``FSDPParam.free_unsharded_param``: ``untyped_storage().resize_(0)``); the next unshard resizes
    it back (a new allocation, a new address) and copies the all-gather result in. After this call the free
    is skipped: the swap still happens, every unshard still all-gathers the current shards (so the optimizer's
    updates are seen, unlike ``set_reshard_after_backward(False)``), and the copy lands at the same address
    each time. Numerics are unchanged; the memory cost is every unit's unsharded parameters held for the
    whole run (as with ``reshard_after_forward=False`` plus no reshard after backward). Returns the number of
    parameters kept. Call after ``fully_shard`` and before capture; undo with :func:`release_unsharded_storage`.
    """
    params = fsdp_params(model)
    if not params:
        raise ValueError(f"fsdp_cudagraph: {type(model).__name__} has no FSDP2 parameters; call "
                         "keep_unsharded_storage on the model after fully_shard")
    for fp in params:
        if not callable(getattr(fp, "free_unsharded_param", None)):
            raise NotImplementedError(
                f"fsdp_cudagraph: torch {torch.__version__}'s FSDPParam has no free_unsharded_param, which "
                "keep_unsharded_storage replaces; use torch 2.11 to 2.13 (the versions checked)")
        fp.free_unsharded_param = keep_storage  # an instance attribute shadows the method
        setattr(fp, KEEP_MARK, True)
    return len(params)


def release_unsharded_storage(model: nn.Module) -> None:
    """Undo :func:`keep_unsharded_storage`; storage of parameters that are sharded now is freed at once."""
    for fp in fsdp_params(model):
        if fp.__dict__.pop(KEEP_MARK, False):
            del fp.free_unsharded_param
            if getattr(fp, "_unsharded_param", None) is not None and fp.sharded_state.name != "UNSHARDED":
                fp.free_unsharded_param()



def _gathered_dtype(fp: Any) -> torch.dtype:
    """The dtype FSDP2 gathers ``fp`` in: its ``param_dtype`` after the clamp of ``FSDPParam.init_dtype_attrs``."""
    orig = getattr(fp, "orig_dtype", None) or fp.sharded_param.dtype
    if hasattr(fp, "param_dtype"):  # set at lazy init
        return fp.param_dtype or orig
    want = getattr(getattr(fp, "mp_policy", None), "param_dtype", None)
    return want if want is not None and want != orig and orig.is_floating_point else orig


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class UnshardedSlots:
    """The slots of one FSDP2 model (see [Note: FSDP2 unsharded-parameter slots]); built by
    :func:`use_unsharded_slots`."""

    def __init__(self, model: nn.Module, units: List[Tuple[str, Any]], num_slots: int) -> None:
        self.num_slots = num_slots
        self._names = {id(g): name for name, g in units}
        # per unit: [(FSDPParam, byte offset, numel, dtype)], the gathered (unpadded-by-rank) flat output
        self._layout: Dict[int, List[Tuple[Any, int, int, torch.dtype]]] = {}
        self._where: Dict[int, Tuple[int, int, torch.dtype]] = {}  # per FSDPParam: (offset, numel, dtype)
        sizes = []
        for name, g in units:
            off, rows = 0, []
            for fp in g.fsdp_params:
                numel, dtype = fp._sharded_param_data.numel() * _shard_size(fp), _gathered_dtype(fp)
                rows.append((fp, off, numel, dtype))
                self._where[id(fp)] = (off, numel, dtype)
                off = _aligned(off + numel * dtype.itemsize)
            self._layout[id(g)] = rows
            sizes.append(off)
        #: Bytes of each slot: the largest unit's gathered parameters (256-byte aligned each).
        self.slot_bytes = max(sizes)
        device = units[0][1].fsdp_params[0].sharded_param.device
        self.buffers = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        self._slot_of = {id(g): i % num_slots for i, (_, g) in enumerate(units)}
        self._bound: Dict[int, Optional[int]] = dict.fromkeys(self._where)  # per FSDPParam: the slot its views are in
        self._owner: List[Optional[int]] = [None] * num_slots
        self._pinned: Dict[int, int] = {}
        self._groups = {id(g): g for _, g in units}

    # -- queries ------------------------------------------------------------------------------------
    def slot_of(self, unit: nn.Module) -> int:
        """The slot ``unit`` (a fully_shard'ed submodule) draws its unsharded parameters from."""
        return self._slot_of[id(self._group_of(unit))]

    def holder(self, slot: int) -> Optional[str]:
        """The name of the unit that holds ``slot`` now (unsharded), or None."""
        gid = self._owner[slot]
        return None if gid is None else self._names[gid]

    def _group_of(self, unit: nn.Module) -> Any:

        state = state_of(unit)
        gs = param_groups(state) if state is not None else []
        if not gs or id(gs[0]) not in self._slot_of:
            raise ValueError(f"fsdp_cudagraph: {type(unit).__name__} is not a unit with an unsharded-parameter slot; "
                             f"pass a fully_shard'ed submodule of the model given to use_unsharded_slots (units: "
                             f"{sorted(self._names.values())[:5]})")
        return gs[0]

    # -- moves ---------------------------------------------------------------------------------------
    def assign(self, unit: nn.Module, slot: int) -> None:
        """Move ``unit`` to ``slot`` from its next all-gather on (between steps; a capture pins it)."""
        g = self._group_of(unit)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"fsdp_cudagraph: slot={slot} is not one of the {self.num_slots} slots of this model")
        gid, name = id(g), self._names[id(g)]
        if gid in self._pinned and self._pinned[gid] != slot:
            raise RuntimeError(
                f"fsdp_cudagraph: FSDP2 unit {name} was captured reading its unsharded parameters in slot "
                f"{self._pinned[gid]}; moving it to slot {slot} would leave its graphs reading the old slot. Keep "
                "its slot while these graphs live (or delete() them, call unpin(), then move it and capture again)")
        if self._owner[self._slot_of[gid]] == gid:
            raise RuntimeError(f"fsdp_cudagraph: FSDP2 unit {name} is unsharded now (it holds slot "
                               f"{self._slot_of[gid]}); move it between steps, when it is resharded")
        self._slot_of[gid] = slot

    def pin(self, units: List[nn.Module]) -> None:
        """Fix the slots of ``units`` (a capture reads their parameters there): :meth:`assign` then refuses."""
        for unit in units:
            try:
                g = self._group_of(unit)
            except ValueError:
                continue  # the root, or a unit without a slot
            self._pinned[id(g)] = self._slot_of[id(g)]

    def unpin(self) -> None:
        self._pinned.clear()

    def register_unsharded(self, unit: nn.Module) -> None:
        """Register ``unit``'s unsharded parameters on its modules without gathering (the FSDP2 adapter's
        ``prepare_capture``): gathering every captured unit at once, as kept storage allows, would need a slot
        per unit. The unit's next unshard gathers into these same parameters (their views are already bound)."""
        g = self._group_of(unit)
        for fp in g.fsdp_params:
            if self._bound[id(fp)] != self._slot_of[id(g)] or getattr(fp, "_unsharded_param", None) is None:
                raise RuntimeError(
                    f"fsdp_cudagraph: FSDP2 unit {self._names[id(g)]} has not been gathered into its slot yet (slots "
                    "were given or a unit moved after the last step); run one eager training step before capture")
            fp._setattr_on_modules(fp._unsharded_param)

    def is_slotted(self, unit: nn.Module) -> bool:
        try:
            self._group_of(unit)
        except ValueError:
            return False
        return True

    # -- what FSDP2 calls (instance attributes on each FSDPParam) -------------------------------------------
    def _alloc(self, g: Any, fp: Any) -> None:
        gid = id(g)
        slot = self._slot_of[gid]
        owner = self._owner[slot]
        if owner is not None and owner != gid:
            raise RuntimeError(
                f"fsdp_cudagraph: FSDP2 unit {self._names[gid]} needs unsharded-parameter slot {slot}, which unit "
                f"{self._names[owner]} still holds (it is unsharded): more units are unsharded at once than the "
                f"{self.num_slots} slots. Slots are for ZeRO-3: every unit resharding after forward and after "
                "backward (reshard_after_forward=True, no set_reshard_after_backward(False)); otherwise use "
                f"use_unsharded_slots(model, num_slots={self.num_slots + 1}) or more, or keep_unsharded_storage "
                "(every unit's parameters held)")
        self._owner[slot] = gid
        if self._bound[id(fp)] != slot:
            self._bind(g, fp, slot)

    def _bind(self, g: Any, fp: Any, slot: int) -> None:
        """Point ``fp``'s gathered output at its place in ``slot`` (FSDP2 has just made it: init_all_gather_outputs)."""
        off, numel, dtype = self._where[id(fp)]
        outs = fp.all_gather_outputs
        if len(outs) != 1 or outs[0].numel() != numel or outs[0].dtype != dtype:
            raise RuntimeError(
                f"fsdp_cudagraph: FSDP2 gathers {fp._module_info.param_name} of unit {self._names[id(g)]} as "
                f"{[(t.numel(), t.dtype) for t in outs]}, not the ({numel}, {dtype}) its slot was laid out for; "
                "this torch's FSDP2 is not the one checked (2.11 to 2.13). Use keep_unsharded_storage instead and "
                "report the version")
        view = self.buffers[slot][off:off + numel * dtype.itemsize].view(dtype)
        outs[0] = view
        # FSDP2 builds the unsharded parameter once, as as_strided(output, storage_offset=0): an offset into
        # the output's storage, which here is the whole slot. Built here at the view's own offset instead,
        # FSDP2's init_unsharded_param finds it initialized and keeps it.
        fp._unsharded_param = nn.Parameter(
            torch.as_strided(view, fp._orig_size, fp._contiguous_orig_stride, view.storage_offset()),
            requires_grad=fp.sharded_param.requires_grad)
        self._bound[id(fp)] = slot

    def _free(self, g: Any, fp: Any) -> None:
        if self._owner[self._slot_of[id(g)]] == id(g):
            self._owner[self._slot_of[id(g)]] = None

    def _release(self) -> None:
        """Back to FSDP2's own storage: each unit's outputs are rebuilt at its next all-gather."""
        held = [self._names[o] for o in self._owner if o is not None]
        if held:
            raise RuntimeError(f"fsdp_cudagraph: FSDP2 units {held} are unsharded now (they hold slots); release the "
                               "slots between steps, when every unit is resharded")
        for g in self._groups.values():
            for fp, *_ in self._layout[id(g)]:
                for name in ("alloc_all_gather_outputs", "free_unsharded_param", SLOT_MARK):
                    fp.__dict__.pop(name, None)
                fp.all_gather_outputs = []
                if hasattr(fp, "_unsharded_param"):
                    del fp._unsharded_param
        self.buffers = []


def _shard_size(fp: Any) -> int:
    """The ranks ``fp``'s unit shards over (its mesh's shard dimension)."""
    return getattr(getattr(fp, "mesh_info", None), "shard_mesh_size", 1)


def slots_of(model: nn.Module) -> Optional[UnshardedSlots]:
    """The slots :func:`use_unsharded_slots` gave ``model`` (its FSDP2 root), or None."""
    return model.__dict__.get(SLOTS_ATTR)


def use_unsharded_slots(model: nn.Module, num_slots: int = 2) -> UnshardedSlots:
    """Draw the unsharded parameters of every FSDP2 unit below ``model`` from ``num_slots`` preallocated slots.

    See [Note: FSDP2 unsharded-parameter slots]. Call after ``fully_shard`` (units and root) and between steps;
    the root's own parameters are kept as :func:`keep_unsharded_storage` keeps
    them. Returns the :class:`UnshardedSlots` (also :func:`slots_of`); undo with :func:`release_unsharded_slots`.
    """

    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"fsdp_cudagraph: num_slots={num_slots!r} must be a positive int (2: a double buffer)")
    if slots_of(model) is not None:
        raise RuntimeError("fsdp_cudagraph: use_unsharded_slots was already called on this model; call "
                           "release_unsharded_slots(model) first (between steps, with no graphs alive)")
    root = state_of(model)
    if root is None:
        raise ValueError(f"fsdp_cudagraph: {type(model).__name__} is not an FSDP2 root; call use_unsharded_slots "
                         "on the model after fully_shard(model)")
    units: List[Tuple[str, Any]] = []
    seen = {id(root)}
    for name, m in model.named_modules():
        state = state_of(m)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        units += [(name, g) for g in param_groups(state)]
    if not units:
        raise ValueError(f"fsdp_cudagraph: {type(model).__name__} has no fully_shard'ed submodules (units); slots "
                         "hold units' unsharded parameters: fully_shard each layer before the root")
    # A unit gathers over its own mesh's shard dimension (with expert parallelism the experts' mesh is smaller than
    # the dense one). A unit on one rank of it is held as the root's parameters are (FSDP2 resizes such a unit's
    # outputs itself); every unit on one rank is one rank, refused.
    single = [(name, g) for name, g in units if _shard_size(g.fsdp_params[0]) < 2]
    if len(single) == len(units):
        raise NotImplementedError(
            "fsdp_cudagraph: unsharded-parameter slots on one rank: FSDP2 then resizes the gathered outputs "
            "itself (alloc_storage), which would resize a slot. Use keep_unsharded_storage (one rank holds every "
            "parameter anyway)")
    for name, g in units:
        for fp in g.fsdp_params:
            pname = f"{name}.{fp._module_info.param_name}"
            if getattr(fp, KEEP_MARK, False):
                raise RuntimeError(f"fsdp_cudagraph: {pname} is under keep_unsharded_storage; call "
                                   "release_unsharded_storage(model) before use_unsharded_slots")
            local = getattr(fp, "_sharded_local_tensor", None)
            if hasattr(local, "fsdp_pre_all_gather") or getattr(fp, "_unsharded_dtensor_spec", None) is not None:
                raise NotImplementedError(
                    f"fsdp_cudagraph: {pname} uses an FSDP2 all-gather extension or is a DTensor (tensor-parallel) "
                    "parameter, whose unsharded parameter is not a plain view of the gathered output a slot holds. "
                    "Use keep_unsharded_storage")
            for meth in ("alloc_all_gather_outputs", "free_unsharded_param", "all_gather_outputs",
                         "_sharded_param_data", "mesh_info", "_orig_size", "_contiguous_orig_stride",
                         "_setattr_on_modules", "init_unsharded_param"):
                if not hasattr(fp, meth):
                    raise NotImplementedError(
                        f"fsdp_cudagraph: torch {torch.__version__}'s FSDPParam has no {meth}, which slots use; use "
                        "torch 2.11 to 2.13 (the versions checked) or keep_unsharded_storage")
    busy = [name for name, g in units if any(fp.sharded_state.name != "SHARDED" for fp in g.fsdp_params)]
    if busy:
        raise RuntimeError(f"fsdp_cudagraph: FSDP2 units {busy[:5]} are unsharded now; call use_unsharded_slots "
                           "between steps, when every unit is resharded")
    units = [u for u in units if all(u[1] is not g for _, g in single)]
    slots = UnshardedSlots(model, units, num_slots)
    for _, g in units:
        for fp in g.fsdp_params:
            fp.alloc_all_gather_outputs = lambda g=g, fp=fp: slots._alloc(g, fp)
            fp.free_unsharded_param = lambda g=g, fp=fp: slots._free(g, fp)
            setattr(fp, SLOT_MARK, True)
    # the root's own parameters, and units sharded over one rank: held, as keep_unsharded_storage holds them
    for g in param_groups(root) + [g for _, g in single]:
        for fp in g.fsdp_params:
            fp.free_unsharded_param = keep_storage
            setattr(fp, KEEP_MARK, True)
    model.__dict__[SLOTS_ATTR] = slots
    return slots


def release_unsharded_slots(model: nn.Module) -> None:
    """Undo :func:`use_unsharded_slots` (between steps): units and root go back to FSDP2's own storage."""

    slots = slots_of(model)
    if slots is None:
        raise ValueError("fsdp_cudagraph: release_unsharded_slots: this model has no slots (use_unsharded_slots "
                         "was not called on it, or they were released)")
    slots._release()
    del model.__dict__[SLOTS_ATTR]
    for fp in fsdp_params(model):  # the root's and the one-rank units' held parameters
        if fp.__dict__.pop(KEEP_MARK, False):
            del fp.free_unsharded_param
            if getattr(fp, "_unsharded_param", None) is not None and fp.sharded_state.name != "UNSHARDED":
                fp.free_unsharded_param()

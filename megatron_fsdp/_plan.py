"""Planning a sharded model, once, in ``fully_shard``: which modules become units and which parameters each
owns, the buffers every unit gets (on-demand, persistent or a double-buffer slot) and its initial values, and
the hooks registered on the unit modules.

``UnitPlanning`` is the part of :class:`~megatron_fsdp._fully_shard.MegatronFSDP` that makes the plan (from its
``__init__`` only; it reads and fills the engine's attributes ``module``, ``units``, ``root_unit``, ...) and
answers questions about it: which unit owns a module, whether a unit runs under activation checkpointing.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn

from . import _collectives as C
from ._common import ShardingStrategy
from ._flat import _Buffer
from ._hsdp import broadcast_order
from ._unit import FSDPUnit
from ._unit_hooks import make_call_guard, make_unit_hooks

__all__ = ["UnitPlanning", "UnitSpec"]

UnitSpec = Union[Type[nn.Module], str]


def _matches(module: nn.Module, specs: Sequence[UnitSpec]) -> bool:
    for s in specs:
        if isinstance(s, str):
            if type(module).__name__ == s:
                return True
        elif isinstance(module, s):
            return True
    return False


class UnitPlanning:
    """Methods of ``MegatronFSDP`` that plan units, buffers and hooks (called from its ``__init__``), and the
    queries on the plan (``unit_of``, ``unit_uses_recompute``)."""

    def _plan_units(self, specs: Sequence[UnitSpec]) -> None:
        if not specs:
            raise ValueError("fsdp_unit_modules is empty; name at least one module class, e.g. your transformer layer")
        owner_of: Dict[int, str] = {}
        unit_modules: List[Tuple[str, nn.Module]] = [
            (n, m) for n, m in self.module.named_modules() if m is not self.module and _matches(m, specs)
        ]
        if not unit_modules:
            found = sorted({type(m).__name__ for m in self.module.modules()})
            raise ValueError(
                f"fsdp_unit_modules={[getattr(s, '__name__', s) for s in specs]} matches no submodule of "
                f"{type(self.module).__name__}; its module classes are {found[:20]}; name one of those"
            )
        unit_set = {id(m) for _, m in unit_modules}
        for index, (name, m) in enumerate(unit_modules):
            names, ps = [], []
            for pn, p in self._own_params(m, unit_set):
                if id(p) in owner_of:
                    raise ValueError(
                        f"parameter {name}.{pn} is shared with unit {owner_of[id(p)]}; a parameter can live in one "
                        "FSDP unit only: untie it, or make the module that owns both a single unit"
                    )
                owner_of[id(p)] = name
                names.append(f"{name}.{pn}")
                ps.append(p)
            self._check_params(name, names, ps)
            if ps:
                self.units.append(FSDPUnit(engine=self, name=name, module=m, names=names, params=ps, index=len(self.units), is_root=False))
        for pn, p in self.module.named_parameters(remove_duplicate=False):
            # A unit parameter also reachable outside that unit (tied to the root, e.g. a norm or a head) would
            # be read through the unit's buffer while the unit is resharded.
            owner = owner_of.get(id(p))
            if owner is not None and not pn.startswith(f"{owner}."):
                raise ValueError(
                    f"parameter {pn} is shared with unit {owner}, outside that unit; a parameter can live in one "
                    "FSDP unit only: untie it, or keep both users outside the units (in the root)"
                )
        root_names, root_params = [], []
        for pn, p in self.module.named_parameters():
            if id(p) not in owner_of:
                root_names.append(pn)
                root_params.append(p)
        if root_params:
            self._check_params("<root>", root_names, root_params)
            self.root_unit = FSDPUnit(engine=self, name="", module=self.module, names=root_names, params=root_params, index=-1, is_root=True)
        for u in self.units:
            u.module._megatron_fsdp_unit = u  # type: ignore[attr-defined]

    @staticmethod
    def _own_params(m: nn.Module, unit_set: set) -> Iterator[Tuple[str, nn.Parameter]]:
        """Parameters of ``m`` that no nested unit claims."""
        stack: List[Tuple[str, nn.Module]] = [("", m)]
        seen: set = set()
        while stack:
            prefix, mod = stack.pop(0)
            for pn, p in mod.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}{pn}", p)
            for cn, child in mod.named_children():
                if id(child) not in unit_set:
                    stack.append((f"{prefix}{cn}.", child))

    def _check_params(self, unit: str, names: List[str], params: List[nn.Parameter]) -> None:
        for n, p in zip(names, params):
            if not p.dtype.is_floating_point:
                raise ValueError(
                    f"parameter {n} of unit {unit} has dtype {p.dtype}; a unit's flat buffer holds floating-point "
                    "parameters cast to one compute dtype; register it as a buffer instead"
                )

    def _build_storage(self, slot_numel: Optional[int]) -> None:
        dev, cdt, gdt = self.device, self.compute_dtype, self.reduce_dtype
        all_units = self.units + ([self.root_unit] if self.root_unit is not None else [])
        db_units: List[FSDPUnit] = []
        if self.fsdp_double_buffer:
            if slot_numel is None:
                slot_numel = max(u.numel for u in self.units) if self.units else 0
            for u in self.units:
                if u.numel <= slot_numel:
                    db_units.append(u)
                elif not self.fsdp_db_use_persist_buf_on_alloc_fail:
                    raise ValueError(
                        f"unit {u.name} needs {u.numel} elements but fsdp_double_buffer_numel={slot_numel}; raise "
                        "fsdp_double_buffer_numel, or set fsdp_db_use_persist_buf_on_alloc_fail=True to give such "
                        "units a persistent buffer of their own"
                    )
        self.slot_numel = slot_numel or 0
        use_p_slots = bool(db_units) and self.strategy.shards_params
        slots_p = [torch.zeros(self.slot_numel, dtype=cdt, device=dev) for _ in range(2)] if use_p_slots else []
        # [Note: one gradient slot] Unshard buffers need two slots (the running unit's and the prefetched
        # one's); gradient buffers one: a unit's buffer is read only by its own reduce-scatter, and the engine
        # keeps one reduction in flight, which the next unit's fold retires before it overwrites the slot,
        # a whole unit's backward after it started. Two fp32 slots cost the largest unit's size in fp32 more
        # (0.78 GiB of an 822 M-parameter model) for one more unit of slack when communication is slower than
        # a unit's backward.
        # With fused weight-gradient accumulation a unit's slot is busy through its whole backward, so on
        # several ranks a second slot lets the previous unit's reduce-scatter overlap this unit's backward.
        fused = any(u.fused is not None and u.fused.any_fused() for u in db_units)
        n_gslots = 2 if fused and self.world_size > 1 else 1
        slots_g = [torch.zeros(self.slot_numel, dtype=gdt, device=dev) for _ in range(n_gslots)] if db_units else []
        # [Note: fixed slots] A double-buffered unit's slot is fixed here, once: the parity of its index among
        # the double-buffered units in plan order (module order, which is forward order for a model that calls
        # its layers in the order it registers them). Fixed, because a CUDA graph replays the addresses it
        # captured: a unit's parameter views and gradient views must sit at the same bytes every step, not
        # in whichever slot happens to be free. Parity, because the unit that computes and the neighbour it
        # prefetches (the next in forward, the previous in backward) then never share a slot; units that nest
        # or run out of plan order can, and unshard refuses to take a slot its owner still computes in. The
        # gradient slot is the same parity folded onto the number of gradient slots ([Note: one gradient slot]).
        slot_of = {id(u): i % 2 for i, u in enumerate(db_units)}
        root_gslot = self._root_grad_slot(db_units, n_gslots)
        with torch.no_grad():
            for u in all_units:
                flat = torch.zeros(u.numel, dtype=torch.float32, device=dev)
                for p, v in zip(u.all_params, u.views(flat)):
                    v.copy_(p.detach())
                for dim, group in broadcast_order(self.hsdp):  # [Note: hybrid sharding]: from mesh (0, 0)
                    what = f"initial values of unit {u.name}" + (f" over the {dim} group" if self.hsdp.hybrid else "")
                    C.broadcast(flat, 0, group, what)
                s = slot_of.get(id(u))
                # Unsharded strategies keep compute parameters resident, so only ZeRO-3 puts them in slots;
                # `optim` (ZeRO-1) keeps its full gradient buffer by definition.
                if s is not None and self.strategy.shards_params:
                    pbuf = _Buffer("slot", slots_p[s], s)
                else:
                    resident = self.fsdp_double_buffer or not self.strategy.shards_params
                    pbuf = _Buffer("persistent" if resident else "dynamic", torch.zeros(u.numel, dtype=cdt, device=dev))
                if s is not None and self.strategy is not ShardingStrategy.OPTIM:
                    gbuf = _Buffer("slot", slots_g[s % n_gslots], s % n_gslots)
                elif u is self.root_unit and root_gslot is not None:
                    gbuf = _Buffer("slot", slots_g[root_gslot], root_gslot)
                else:
                    gkeep = self.fsdp_double_buffer or self.strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM)
                    gbuf = _Buffer("persistent" if gkeep else "dynamic", torch.zeros(u.grad_numel, dtype=gdt, device=dev))
                u.init_storage(flat, pbuf, gbuf)

    def _root_grad_slot(self, db_units: List[FSDPUnit], n_gslots: int) -> Optional[int]:
        """The gradient slot the root unit borrows, or None for a buffer of its own.

        [Note: the root's gradients in a slot] The root's parameters (embeddings, output layer, final norm)
        fold and reduce once per backward, in its post-backward at the very end, when every unit's backward is
        over. A buffer of its own would hold ``grad_numel`` elements for the whole run (64 MiB of fp32 in the
        compute config; the 2-GPU eager peak exceeded FSDP2's by about that much, S10); a slot is
        free then: it takes the slot the first unit of plan order (whose backward ran just before) does not
        use, retiring that slot's earlier reduction like any unit. Not when a TE module of the root writes its
        weight gradient during the backward (fused weight-gradient accumulation): it would hold the slot from
        its first GEMM, while the units still need it.
        """
        root = self.root_unit
        if root is None or not db_units or self.strategy is ShardingStrategy.OPTIM or not root.grad_numel:
            return None
        if root.grad_numel > self.slot_numel or (root.fused is not None and root.fused.any_fused()):
            return None
        return 1 % n_gslots

    def _register_hooks(self) -> None:
        for u in self.units:
            pre, reg_post_bwd, post, reg_pre_bwd = make_unit_hooks(u)
            m = u.module
            u.hook_handles = [
                m.register_forward_pre_hook(pre),
                m.register_forward_pre_hook(reg_post_bwd, with_kwargs=True),
                m.register_forward_hook(post),
                m.register_forward_hook(reg_pre_bwd),
            ]
            # [Note: calls outside the unit] every submodule that owns parameters of this unit refuses calls
            # made while the unit is not computing.
            for name, sub in self._param_owners(u):
                u.hook_handles.append(sub.register_forward_pre_hook(make_call_guard(u, name)))

    def _param_owners(self, unit: FSDPUnit) -> List[Tuple[str, nn.Module]]:
        """Submodules of ``unit`` (not the unit itself, not inside a nested unit) that own its parameters."""
        mine = {id(p) for p in unit.all_params}
        nested = {id(u.module) for u in self.units if u is not unit}
        out: List[Tuple[str, nn.Module]] = []
        stack = [(unit.name, unit.module)]
        while stack:
            prefix, mod = stack.pop()
            for cn, child in mod.named_children():
                if id(child) in nested:
                    continue
                qual = f"{prefix}.{cn}" if prefix else cn
                if any(id(p) in mine for p in child.parameters(recurse=False)):
                    out.append((qual, child))
                stack.append((qual, child))
        return out

    # ------------------------------------------------------------------ queries on the plan
    def unit_of(self, module: nn.Module) -> Optional[FSDPUnit]:
        """The unit that owns ``module`` (the nearest enclosing unit module), or None for the root."""
        for m in self._ancestors(module):
            u = getattr(m, "_megatron_fsdp_unit", None)
            if u is not None and u.engine is self:
                return u
        return None

    def _ancestors(self, module: nn.Module) -> List[nn.Module]:
        path = {id(m): n for n, m in self.module.named_modules()}
        if id(module) not in path:
            raise ValueError(f"{type(module).__name__} is not a submodule of the sharded model")
        name = path[id(module)]
        out = [module]
        while name:
            name = name.rsplit(".", 1)[0] if "." in name else ""
            out.append(self.module.get_submodule(name) if name else self.module)
        return out

    def unit_uses_recompute(self, unit: FSDPUnit) -> bool:
        """Whether ``unit`` runs under activation checkpointing: seen recomputing, or inside a checkpoint wrapper.

        A graph layer calls it to refuse graphing such units: a recomputed forward would replay the graph
        inside backward. The dynamic half only knows after an eager step that ran backward.
        """
        if unit.recomputed:
            return True
        return any(type(m).__name__ == "CheckpointWrapper" or hasattr(m, "_checkpoint_wrapped_module")
                   for m in self._ancestors(unit.module))

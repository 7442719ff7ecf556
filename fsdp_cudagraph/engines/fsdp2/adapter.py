"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) as an engine of the graph layer.

FSDP2 drives one unit (one ``fully_shard``'ed module, one ``FSDPParamGroup``) from two module hooks, both
bound methods of its ``FSDPState``: ``_pre_forward`` (root lazy init, unshard + wait, then a
``RegisterPostBackwardFunction`` on the inputs) and ``_post_forward`` (reshard, then ``_pre_backward``
tensor hooks on the outputs). Neither can run at capture: the autograd registrations would be captured
once and never replayed. :meth:`FSDP2Engine.hook_plan` withholds both and plans their effects on the
param group directly, as TE's ``capture_time_hooks``.

[Note: FSDP2 internals relied on]
Checked against torch 2.11 and 2.13 (``torch/distributed/fsdp/_fully_shard/``): ``FSDPModule``,
``FSDPState._pre_forward``/``_post_forward``/``_root_post_backward_final_callback``/``_fsdp_param_groups``
(2.13; 2.11 has one optional ``_fsdp_param_group``, read through :func:`param_groups`)/
``_training_state``/``_state_ctx``, ``FSDPParamGroup.unshard``/``wait_for_unshard``/``reshard``/
``pre_backward``/``post_backward``/``_record_post_forward``/``_reshard_after_forward``/
``reshard_after_backward``/``fsdp_params``/``offload_policy``/``mp_policy``, ``FSDPParam._unsharded_param``
and ``sharded_param``, ``TrainingState``. :func:`_internals` checks them once and refuses with the missing
names instead of failing deep inside a capture.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from fsdp_cudagraph.engines.contract import EngineAdapter, HookPlan, PerLayerEngine, ReplayProbe
from fsdp_cudagraph.engines.registry import register_engine
from fsdp_cudagraph.engines.fsdp2.storage import KEEP_MARK, SLOT_MARK, param_groups, slots_of, state_of

__all__ = ["FSDP2Engine"]

#: The torch.distributed functions FSDP2 looks up at call time (2.11: *_into_tensor / *_tensor; 2.13: *_single).
_COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier")

_STATE_NAMES = ("_pre_forward", "_post_forward", "_root_post_backward_final_callback", "_training_state",
                "_state_ctx")
_GROUP_NAMES = ("unshard", "wait_for_unshard", "reshard", "pre_backward", "post_backward", "_record_post_forward",
                "_reshard_after_forward", "reshard_after_backward", "fsdp_params", "offload_policy", "mp_policy",
                "unshard_async_op", "_training_state")


@functools.lru_cache(maxsize=None)
def _internals():
    """(FSDPModule, FSDPState, TrainingState, fully_shard module) or NotImplementedError naming what is missing."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_state
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise NotImplementedError(f"fsdp_cudagraph: this torch ({torch.__version__}) has no FSDP2 "
                                  f"(torch.distributed.fsdp.fully_shard): {exc}; use torch >= 2.11") from exc
    missing = [f"FSDPState.{n}" for n in _STATE_NAMES[:3] if not hasattr(_fsdp_state.FSDPState, n)]
    if missing:
        raise NotImplementedError(
            f"fsdp_cudagraph: torch {torch.__version__}'s FSDP2 lacks {missing}, which the FSDP2 adapter "
            "drives at capture time; use torch 2.11 to 2.13 (the versions checked) or report the version")
    return FSDPModule, _fsdp_state.FSDPState, _fsdp_common.TrainingState


@register_engine
class FSDP2Engine(EngineAdapter, PerLayerEngine):
    """A model wrapped by PyTorch FSDP2's ``fully_shard`` (its root is an ``FSDPModule``).

    Units are the ``fully_shard``'ed submodules below the root, in module order (which is forward order for
    the layer stacks FSDP2 is applied to). The root is not a unit: its hooks wrap the whole model call, which
    a per-layer graph never captures; a callable owned by the root's own parameters reports the root from
    :meth:`unit_of`. Address stability needs :func:`keep_unsharded_storage` (any reshard setting) or no
    resharding at all (see docs/engines.md, "PyTorch FSDP2").
    """

    name = "torch FSDP2"
    address_hint = "Keep keep_unsharded_storage(model) in force (release_unsharded_storage frees what the graphs read)."

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        _internals()
        self._pending: set = set()
        self._check_names()  # units forwarded at capture time whose post-backward has not run yet

    def _check_names(self) -> None:
        """Refuse at once a torch whose FSDP2 lacks an attribute the capture-time hooks use."""
        missing = set()
        for m in self.model.modules():
            state = state_of(m)
            if state is None:
                continue
            missing |= {f"FSDPState.{n}" for n in _STATE_NAMES + ("_states_to_backward_prefetch",)
                        if not hasattr(state, n)}
            for g in param_groups(state):
                missing |= {f"FSDPParamGroup.{n}" for n in _GROUP_NAMES if not hasattr(g, n)}
                for fp in g.fsdp_params:
                    missing |= {f"FSDPParam.{n}" for n in ("_module_info", "sharded_param", "free_unsharded_param")
                                if not hasattr(fp, n)}
        if missing:
            raise NotImplementedError(
                f"fsdp_cudagraph: torch {torch.__version__}'s FSDP2 lacks {sorted(missing)}, which the FSDP2 "
                "adapter drives at capture time; use torch 2.11 to 2.13 (the versions checked) or report the version")

    @classmethod
    def recognizes(cls, model: nn.Module) -> bool:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            return False
        return isinstance(model, FSDPModule)

    @property
    def root(self) -> nn.Module:
        return self.model

    # -- units ------------------------------------------------------------------------------------
    def unit_modules(self) -> List[nn.Module]:
        return [m for m in self.model.modules() if m is not self.model and state_of(m) is not None]

    def unit_of(self, module: nn.Module) -> Optional[nn.Module]:
        owner = None
        for m in self.model.modules():
            if state_of(m) is not None and any(s is module for s in m.modules()):
                owner = m  # modules() is pre-order: the last hit is the nearest ancestor
        return owner

    def _group(self, unit: nn.Module):
        state = state_of(unit)
        if state is None:
            raise ValueError(f"fsdp_cudagraph: module {type(unit).__name__} is not a fully_shard'ed unit of "
                             f"{self.name}; pass a module from unit_modules()")
        groups = param_groups(state)
        return state, (groups[0] if groups else None)

    # -- hooks ------------------------------------------------------------------------------------
    def hook_plan(self, hooks: Mapping[str, Mapping[int, Any]]) -> HookPlan:
        _, FSDPState, _ = _internals()
        plan = HookPlan()
        for dict_name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            for hid, hook in hooks.get(dict_name, {}).items():
                owner = getattr(hook, "__self__", None)
                fname = getattr(getattr(hook, "__func__", None), "__name__", None)
                if isinstance(owner, FSDPState) and fname in ("_pre_forward", "_post_forward"):
                    plan.withheld.append((dict_name, hid, hook))
                    for key, fn in self._capture_time(owner, fname).items():
                        plan.capture_time[key][hid] = fn
                else:
                    plan.unknown.append((dict_name, hid, hook))
        return plan

    def _capture_time(self, state, fname: str) -> Dict[str, Any]:
        """The eager hook's effect on FSDP2's state without its autograd registrations (see module docstring).

        [Note: FSDP2 mixed precision under partial graphs]
        A ``MixedPrecisionPolicy`` acts in three places, none of them inside a graphed forward: ``_pre_forward``
        casts the unit's floating-point inputs to ``param_dtype``, the all-gather casts the fp32 shards to
        ``param_dtype`` into the unsharded parameters, ``_post_forward`` casts the outputs to ``output_dtype``,
        and ``post_backward`` casts the unsharded gradients to ``reduce_dtype`` before the reduce-scatter. At
        replay the eager hooks are back on the module and wrap the graphed forward as they wrap the eager one,
        so the casts run as autograd ops around the replay. At capture the withheld hooks need not cast: the
        graph layer records the sample args from a forward-pre hook registered after FSDP2's (which FSDP2
        prepends), so they are already the cast inputs, and the capture-time unshard below gathers in
        ``param_dtype`` as eager does. The unsharded ``param_dtype`` parameter views ``all_gather_outputs``,
        the storage ``keep_unsharded_storage`` keeps; the graph's parameter gradients accumulate into its
        ``.grad`` in ``param_dtype``, and the capture-time ``post_backward`` casts them as eager does.
        """
        _, _, TS = _internals()
        if fname == "_pre_forward":
            def forward_pre(module: nn.Module) -> None:
                state._training_state = TS.FORWARD
                for g in param_groups(state):
                    g._training_state = TS.FORWARD
                    g.unshard(g.unshard_async_op)
                    g.wait_for_unshard()
                self._pending.add(state)

            def backward(module: nn.Module) -> None:
                for g in param_groups(state):
                    g.post_backward()  # reduce-scatter the unsharded grads into the sharded .grad; reshard
                self._pending.discard(state)
                if not self._pending:
                    self._final_callback()
            return {"forward_pre_hooks": forward_pre, "backward_hooks": backward}

        def forward(module: nn.Module) -> None:
            for g in param_groups(state):
                g.reshard()  # a no-op unless it reshards after forward
                g._record_post_forward()
                g._training_state = TS.IDLE
            state._training_state = TS.IDLE

        def backward_pre(module: nn.Module) -> None:
            state._training_state = TS.PRE_BACKWARD
            for g in param_groups(state):
                g.pre_backward(len(state._states_to_backward_prefetch) == 0)
        return {"forward_hooks": forward, "backward_pre_hooks": backward_pre}

    def _final_callback(self) -> None:
        """What autograd's queued ``_root_post_backward_final_callback`` does at the end of an eager backward."""
        root = state_of(self.model)
        if root is not None:
            root._root_post_backward_final_callback()

    def prepare_capture(self, units: List[nn.Module]) -> None:
        # Between steps an FSDP2 unit registers its sharded DTensors; its pre-forward swaps in the unsharded
        # parameters. TE's graph maker reads module.parameters() before that hook runs, so without this the
        # graph's inputs would be the DTensors, and a replay's gradients would reach no parameter FSDP2 reduces.
        slots = slots_of(self.model)  # storage.use_unsharded_slots
        for unit in units:
            if slots is not None and slots.is_slotted(unit):
                slots.register_unsharded(unit)  # not gathered: units share slots (see storage.py)
                continue
            state = state_of(unit)
            for g in (param_groups(state) if state is not None else ()):
                g.unshard(g.unshard_async_op)
                g.wait_for_unshard()  # registers the unsharded parameters on the modules
        if slots is not None:
            slots.pin(units)  # a captured unit may not move to another slot

    # -- what must not move -----------------------------------------------------------------------
    def check_partial_graphs(self) -> None:
        for unit in [self.model] + self.unit_modules():
            state, g = self._group(unit)
            if g is None:
                continue
            name = self.unit_name(unit)
            if len(getattr(state, "_modules", (unit,))) > 1:
                raise NotImplementedError(
                    f"[rank {self.rank}] fsdp_cudagraph: FSDP2 unit {name} is one of "
                    f"{len(state._modules)} modules sharded together by fully_shard([...]); their hooks are "
                    "group wrappers the FSDP2 adapter does not plan. Apply fully_shard to each layer on its own "
                    "for per-layer graphs")
            kept = all(getattr(fp, KEEP_MARK, False) or getattr(fp, SLOT_MARK, False) for fp in g.fsdp_params)
            if g._reshard_after_forward and not kept:
                raise NotImplementedError(
                    f"[rank {self.rank}] fsdp_cudagraph: FSDP2 unit {name} has reshard_after_forward=True "
                    "(ZeRO-3): FSDP2 frees its unsharded parameters after forward and re-allocates them at the "
                    "next all-gather, so they move between capture and replay. Call "
                    "fsdp_cudagraph.keep_unsharded_storage(model) after fully_shard (same "
                    "numerics, unsharded parameters stay allocated), or "
                    "fsdp_cudagraph.use_unsharded_slots(model) (same numerics, two slots "
                    "the size of the largest unit), or capture the whole step (full_iteration)")
            if g.reshard_after_backward and not kept:
                raise NotImplementedError(
                    f"[rank {self.rank}] fsdp_cudagraph: FSDP2 unit {name} has reshard_after_backward=True: "
                    "its unsharded parameters are freed after backward and re-allocated at the next all-gather, "
                    "so they move between capture and replay. Call "
                    "fsdp_cudagraph.keep_unsharded_storage(model) after fully_shard, or capture "
                    "the whole step (full_iteration). (model.set_reshard_after_backward(False) would keep them "
                    "too, but FSDP2 then skips the next all-gather, so a forward after optimizer.step() would "
                    "not see the update: it is meant for micro-batches of one step)")
            from torch.distributed.fsdp import CPUOffloadPolicy
            if isinstance(g.offload_policy, CPUOffloadPolicy):
                raise NotImplementedError(
                    f"[rank {self.rank}] fsdp_cudagraph: FSDP2 unit {name} uses CPUOffloadPolicy: its sharded "
                    "parameters and gradients live on the host and are copied in hooks a graph cannot replay. "
                    "Drop offload_policy for per-layer graphs")
            # Any MixedPrecisionPolicy is accepted: see [Note: FSDP2 mixed precision under partial graphs].

    def replay_tensors(self, module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        return [(name, p) for name, fp in self._replay_params(module)
                if (p := getattr(fp, "_unsharded_param", None)) is not None]

    def replay_probe(self, module: nn.Module) -> ReplayProbe:
        # The unit, its group and the FSDPParams inside ``module`` are found once; a call reads each one's
        # unsharded parameter as it is now (FSDP2 re-registers it at every unshard), as replay_tensors does.
        fsdp_params = [fp for _, fp in self._replay_params(module)]

        def probe() -> Tuple[int, ...]:
            return tuple(p.data_ptr() for fp in fsdp_params if (p := getattr(fp, "_unsharded_param", None)) is not None)
        return probe

    def _replay_params(self, module: nn.Module) -> List[Tuple[str, Any]]:
        """(name in ``module``, FSDPParam) of the owning unit's parameters that live inside ``module``."""
        unit = self.unit_of(module)
        if unit is None:
            return []
        _, g = self._group(unit)
        if g is None:
            return []
        names = {id(m): n for n, m in module.named_modules()}
        out = []
        for fp in g.fsdp_params:
            owner = fp._module_info.module
            if id(owner) in names:
                prefix = names[id(owner)]
                out.append(((prefix + "." if prefix else "") + fp._module_info.param_name, fp))
        return out

    # -- capture guard ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture_guard(self) -> Iterator[None]:
        dist = torch.distributed
        rank = self.rank
        saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

        def refuse(name):
            def fn(*args, **kwargs):
                raise RuntimeError(
                    f"[rank {rank}] fsdp_cudagraph: torch.distributed.{name} was called inside a CUDA graph "
                    "capture under FSDP2; a collective cannot be captured into a per-layer graph. FSDP2's "
                    "collectives must run in its capture-time hooks (outside capture): check that the unit's "
                    "hooks were extracted and that no prefetch targets a captured unit")
            return fn
        try:
            for n in saved:
                setattr(dist, n, refuse(n))
            yield
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)

    def reset(self) -> None:
        # Capture-time forwards whose backward never ran (a failed capture): finish the step as autograd's
        # final callback would, so the next eager forward starts from idle. Nothing is resharded here: under
        # the settings check_partial_graphs accepts, resharding would move the parameters a graph reads.
        if self._pending:
            self._pending.clear()
            self._final_callback()

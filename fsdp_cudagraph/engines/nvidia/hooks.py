"""How NVIDIA's Megatron-FSDP is recognised: its engine classes by path, its hooks by structure.

Read by the adapter (``adapter.py``); like it, this module imports nothing of megatron. Importing it
installs :data:`DEVICE_WARNING_FILTER` on the engine modules' loggers.

[Note: NVIDIA Megatron-FSDP internals relied on]
Read in Megatron-FSDP 0.3.1 (bundled in megatron-core 0.16.1, run on CPU) and 0.6.1 (bundled in megatron-core
0.19.2, byte-identical to the standalone ``megatron-fsdp`` 0.6.1); other versions are refused by the adapter's
:func:`check_version`. ``MegatronFSDP._register_fsdp_hooks`` (``megatron_fsdp.py``) registers, with no
sentinel attributes, closures local to that method (``__qualname__`` ``MegatronFSDP._register_fsdp_hooks.
<locals>.NAME``; ``torch.compiler.disable`` wraps some, ``__wrapped__`` leads back):

- on every module outside an FSDP unit and on every unit, a forward-pre hook ``_pre_forward_param_unshard``
  (``prepend=True, with_kwargs=True``; all-gather and wait, prefetch the next bucket) -- planned as is;
- on every unit, a forward hook ``_post_forward`` (release the unit's bucket) -- planned as is; on other
  modules under ``optim_grads_params``, a forward hook ``_release_module_fp8_transpose_cache`` -- planned;
- on every unit, a forward hook ``forward_hook`` made by ``create_custom_backward_hook(module,
  custom_backward_handler)``: it only registers ``custom_backward_handler`` on the outputs with
  ``register_multi_grad_hook``. The handler is the closure's free variable ``custom_backward_handler``:
  ``_pre_backward_param_unshard`` -- the wrapper is withheld, the handler planned under
  ``backward_pre_hooks``;
- under ``optim_grads_params``, on every unit, a forward-pre hook ``functools.partial(
  _register_post_backward_hook, _post_backward_release_module)``: it only wraps the inputs in
  ``RegisterFSDPBackwardFunction`` whose backward calls the handler -- withheld, ``partial.args[0]``
  planned under ``backward_hooks``;
- ``create_custom_backward_hook(m, _root_pre_backward)`` on every module that holds all parameters, and once
  more on whichever module ``named_modules()`` yields last (the method reuses its loop variable) --
  the engine's own (``engine_only``), never run at capture (it queues the root post-backward, a reduce-scatter);
- post-accumulate-grad hooks on parameters (``_process_post_backward_gradients``: main_grad accumulation and
  the bucket's reduce-scatter). TE's graph maker runs its warmup and capture backwards with
  ``torch.autograd.backward``, so these would fire there (on an H100 they waited on an event inside the
  capture: ``CUDA error: invalid argument``); the graph layer parks every captured parameter's hooks while a
  graph maker runs ([Note: post-accumulate-grad hooks at capture], capture/schedules.py) and they
  fire at each replay. State-dict
  hooks are not module hooks.

Every recognised closure must also close over this very engine (its ``self`` cell, searched through the
closures it calls): a hook of another engine, or a look-alike, is unknown.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Tuple

from torch import nn

__all__ = ["DEVICE_WARNING_FILTER", "identify_hook"]

#: (module, class) of NVIDIA's engine: megatron-core's bundled copy, and the standalone package's.
_ENGINE_CLASSES = {
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp", "MegatronFSDP"),
    ("megatron_fsdp.megatron_fsdp", "MegatronFSDP"),
}


class _DeviceWarningOnce(logging.Filter):
    """Lets Megatron-FSDP's "is using device ... instead of the current device" warning through once per process.

    NVIDIA's engine logs it at every construction (every build of a benchmark or alignment run repeats it, word
    for word); the first says all there is to say. Other records pass untouched.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Megatron-FSDP is using device" not in message:
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


#: Installed on the engine modules' loggers by name (importing nothing of megatron).
DEVICE_WARNING_FILTER = _DeviceWarningOnce()
for _module, _ in _ENGINE_CLASSES:
    logging.getLogger(_module).addFilter(DEVICE_WARNING_FILTER)

#: megatron-core's wrapper around it (``.module`` is the MegatronFSDP).
_MCORE_CLASSES = {("megatron.core.distributed.fsdp.mcore_fsdp_adapter", "FullyShardedDataParallel")}

_LOCALS = "MegatronFSDP._register_fsdp_hooks.<locals>."
#: closure name -> role, for the hook objects themselves.
_HOOK_ROLES = {
    "_pre_forward_param_unshard": "pre_forward",
    "_post_forward": "post_forward",
    "_release_module_fp8_transpose_cache": "post_forward",
}
_BACKWARD_WRAPPER = "create_custom_backward_hook.<locals>.forward_hook"
_POST_BACKWARD_REGISTRAR = "_register_post_backward_hook"
#: handler name -> role, for the handlers inside the two wrappers.
_HANDLER_ROLES = {
    "_pre_backward_param_unshard": "pre_backward",
    "_root_pre_backward": "root_pre_backward",
    "_post_backward_release_module": "post_backward",
}
#: role -> (the hook dict it sits in, the TE key it is planned under or None, how TE's fn calls it).
_PLANS = {
    "pre_forward": ("_forward_pre_hooks", "forward_pre_hooks", "pre"),
    "post_forward": ("_forward_hooks", "forward_hooks", "post"),
    "pre_backward": ("_forward_hooks", "backward_pre_hooks", "handler"),
    "post_backward": ("_forward_pre_hooks", "backward_hooks", "handler"),
    "root_pre_backward": ("_forward_hooks", None, None),
}


# -- engine recognition ---------------------------------------------------------------------------------
def _class_key(cls: type) -> Tuple[str, str]:
    return getattr(cls, "__module__", ""), getattr(cls, "__qualname__", "")


def _is_engine(obj: Any) -> bool:
    return any(_class_key(c) in _ENGINE_CLASSES for c in type(obj).__mro__)


def _is_mcore_wrapper(obj: Any) -> bool:
    return any(_class_key(c) in _MCORE_CLASSES for c in type(obj).__mro__)


def _engine_of(model: nn.Module) -> nn.Module:
    """NVIDIA's MegatronFSDP in ``model`` (itself, or megatron-core's wrapper's ``.module``)."""
    if _is_engine(model):
        return model
    inner = getattr(model, "module", None)
    if _is_mcore_wrapper(model) and inner is not None and _is_engine(inner):
        return inner
    raise TypeError(f"fsdp_cudagraph: {type(model).__module__}.{type(model).__qualname__} is not NVIDIA's "
                    "MegatronFSDP nor megatron-core's FullyShardedDataParallel around one")



# -- hook recognition -----------------------------------------------------------------------------------
def _unwrap(fn: Any) -> Any:
    """Past ``torch.compiler.disable`` (and any functools.wraps) to the function NVIDIA wrote."""
    seen = 0
    while hasattr(fn, "__wrapped__") and seen < 8:
        fn, seen = fn.__wrapped__, seen + 1
    return fn


def _local_name(fn: Any) -> Optional[str]:
    """The name of ``fn`` inside ``MegatronFSDP._register_fsdp_hooks`` (None if it is not defined there)."""
    qualname = getattr(_unwrap(fn), "__qualname__", "")
    return qualname[len(_LOCALS):] if qualname.startswith(_LOCALS) else None


def _free_var(fn: Any, name: str) -> Any:
    """The value of free variable ``name`` of ``fn`` (unwrapped), or None."""
    fn = _unwrap(fn)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _owner(fn: Any, depth: int = 3) -> Any:
    """The MegatronFSDP a closure of ``_register_fsdp_hooks`` serves: its ``self``, or that of a closure it calls."""
    fn = _unwrap(fn)
    own = _free_var(fn, "self")
    if own is not None or depth == 0:
        return own
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    for cell in cells:
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if callable(inner) and _local_name(inner) is not None:
            found = _owner(inner, depth - 1)
            if found is not None:
                return found
    return None


def identify_hook(hook: Any, engine: Any) -> Optional[Tuple[str, Callable[..., Any]]]:
    """(role, the callable a capture-time hook calls) of one of ``engine``'s hooks, None for any other hook.

    Roles: ``pre_forward``, ``post_forward`` (the hook itself is called), ``pre_backward``,
    ``post_backward`` (the inner handler of a wrapper is called), ``root_pre_backward`` (the engine's, not run
    at capture). Structure only, pinned to the versions in the adapter's TESTED_VERSIONS (see the module's note).
    """
    if isinstance(hook, functools.partial):
        if _local_name(hook.func) != _POST_BACKWARD_REGISTRAR or len(hook.args) != 1 or hook.keywords:
            return None
        handler = hook.args[0]
        if _HANDLER_ROLES.get(_local_name(handler) or "") != "post_backward":
            return None
        return ("post_backward", handler) if _owner(handler) is engine else None
    name = _local_name(hook)
    if name is None:
        return None
    if name == _BACKWARD_WRAPPER:
        handler = _free_var(hook, "custom_backward_handler")
        role = _HANDLER_ROLES.get(_local_name(handler) or "") if handler is not None else None
        if role not in ("pre_backward", "root_pre_backward"):
            return None
        return (role, handler) if _owner(handler) is engine else None
    role = _HOOK_ROLES.get(name)
    if role is None:
        return None
    # The FP8 cache release reads no engine state (it closes over no ``self``): any engine's will do.
    if name != "_release_module_fp8_transpose_cache" and _owner(hook) is not engine:
        return None
    return role, hook


def _te_form(fn: Callable[..., Any], kind: str) -> Callable[[nn.Module], None]:
    """A hook or handler in TE's ``fn(module) -> None`` form (NVIDIA's return the arguments or the output)."""
    if kind == "pre":
        def run(module: nn.Module) -> None:
            fn(module, (), {})  # 0.3.1 takes (module, args, kwargs), 0.6.1 (module, *unused)
    elif kind == "post":
        def run(module: nn.Module) -> None:
            fn(module, (), None)
    else:
        def run(module: nn.Module) -> None:
            fn(module)
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run

"""Calls that mix tensors with constants: flatten them for a graph, bind the constants, check every replay.

[Note: graphed calls with constants]
Graph makers take positional tensors only (``torch.cuda.make_graphed_callables``) or trees of tensors
(TE), but real layers are called like HuggingFace decoder layers: ``layer(h, attention_mask=None,
position_embeddings=(cos, sin), past_key_values=None, use_cache=False)``. A call is flattened into its
tensor leaves and a *signature*: a nested tuple that holds the structure (containers, keyword names), the
constants (None, bool, int, float, str, dtypes, devices, enums) and, per tensor, its shape, dtype, device
and ``requires_grad``. The graph maker is handed a :class:`CallWrapper`, a small module whose
``forward(*tensors)`` rebuilds the call from the signature (so the constants are bound at capture) and
calls the original module's own ``forward`` (not ``__call__``: the module's FSDP and user hooks are
handled by the capture layer and must not run inside a graph), then flattens the output to a tuple of
tensors and remembers the output's structure.

After capture the module's ``forward`` is a :class:`Dispatcher`: per call it flattens the arguments and
compares the signature with capture's (one tuple comparison). Equal: replay, rebuild the output (a tensor,
a tuple with None entries, a dict or ModelOutput-like object). Different: the call runs the module's own
forward eagerly, with one warning per callable naming the argument that changed, or, in strict mode, a
ValueError. A module in another train/eval mode than at capture runs eagerly without a warning (like TE's
and torch's graphed modules). A replay therefore never computes with constants or shapes other than the
call's own.

What the signature cannot see (documented in docs/models.md): Python side effects inside the callable
(they happen at capture only), global state such as autocast, and objects it cannot flatten: those are
refused at capture (``TypeError`` naming the argument), and at replay make the call run eagerly.
"""

from __future__ import annotations

import enum
import inspect
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = [
    "flatten",
    "rebuild",
    "record_call",
    "check_signature",
    "check_recorded",
    "describe_change",
    "arg_names",
    "call_with",
    "eager_forward",
    "CallWrapper",
    "Dispatcher",
    "SignatureChangedWarning",
]

# Node tags of a signature (small ints: tuple comparison stays in C).
_TENSOR, _CONST, _SEQ, _MAP, _OPAQUE = range(5)

#: Constants bound at capture, matched by exact type (so a bool is never taken for an int).
_ATOMS = frozenset(
    [type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format, type(Ellipsis)]
)

Signature = Tuple[Any, ...]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


class SignatureChangedWarning(RuntimeWarning):
    """A graphed callable was called with other constants, shapes or dtypes than at capture: it ran eagerly."""


# ---------------------------------------------------------------------------------------------- flatten


def _flatten(obj: Any, leaves: List[torch.Tensor]) -> Signature:
    cls = type(obj)
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return (_TENSOR, obj.shape, obj.dtype, obj.device, obj.requires_grad)
    if cls is float:
        # hex() keeps -0.0 apart from 0.0 and makes nan equal to itself: the same constant, bit for bit.
        return (_CONST, float, obj.hex())
    if cls in _ATOMS or isinstance(obj, enum.Enum):
        # The type is part of the key: True == 1 == 1.0 in Python, but a layer may branch on `is True`.
        return (_CONST, cls, obj)
    if cls is tuple or cls is list or (isinstance(obj, tuple) and hasattr(cls, "_fields")):
        return (_SEQ, cls, tuple([_flatten(x, leaves) for x in obj]))
    if isinstance(obj, dict):  # dict, OrderedDict, HF ModelOutput (an OrderedDict of its non-None fields)
        return (_MAP, cls, tuple(obj.keys()), tuple([_flatten(v, leaves) for v in obj.values()]))
    return (_OPAQUE, cls)


def flatten(obj: Any) -> Tuple[List[torch.Tensor], Signature]:
    """Split ``obj`` into its tensor leaves (in order) and its signature (structure, constants, tensor metadata).

    Containers: tuple, list, namedtuple, dict and dict subclasses (HF ``ModelOutput``). Constants: None,
    bool, int, float, str, bytes, torch dtype/device/layout/memory_format, enums. Anything else becomes an
    opaque node that :func:`check_signature` refuses and that never equals a checked signature.
    """
    leaves: List[torch.Tensor] = []
    return leaves, _flatten(obj, leaves)


def _rebuild(sig: Signature, it: Iterator[Any]) -> Any:
    tag = sig[0]
    if tag == _TENSOR:
        return next(it)
    if tag == _CONST:
        return float.fromhex(sig[2]) if sig[1] is float else sig[2]
    if tag == _SEQ:
        items = [_rebuild(s, it) for s in sig[2]]
        cls = sig[1]
        if cls is tuple:
            return tuple(items)
        if cls is list:
            return items
        return cls(*items)  # namedtuple
    if tag == _MAP:
        cls, keys = sig[1], sig[2]
        values = [_rebuild(s, it) for s in sig[3]]
        if cls is dict or cls is OrderedDict:
            return cls(zip(keys, values))
        if all(type(k) is str for k in keys):
            return cls(**dict(zip(keys, values)))  # dataclass-like mappings (ModelOutput) take their fields
        return cls(zip(keys, values))
    raise TypeError(f"cannot rebuild an opaque {sig[1].__name__} object")  # refused at capture; internal


def rebuild(sig: Signature, leaves: Sequence[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`: the object of signature ``sig`` with ``leaves`` as its tensors."""
    it = iter(leaves)
    out = _rebuild(sig, it)
    if next(it, None) is not None:
        raise AssertionError("more tensors than the signature holds")
    return out


# ---------------------------------------------------------------------------------------------- names, messages


def arg_names(fn: Callable[..., Any]) -> List[str]:
    """Names of ``fn``'s positional parameters (to name ``args[i]`` in messages); empty if unknown."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _top(sig: Signature, names: Sequence[str]) -> List[Tuple[str, Signature]]:
    """The (name, signature) of each argument of a call signature ``flatten((args, kwargs))``."""
    args_sig, kwargs_sig = sig[2]
    out = [(names[i] if i < len(names) else f"args[{i}]", s) for i, s in enumerate(args_sig[2])]
    out += [(str(k), s) for k, s in zip(kwargs_sig[2], kwargs_sig[3])]
    return out


def _walk(sig: Signature, path: str) -> Iterator[Tuple[str, Signature]]:
    yield path, sig
    if sig[0] == _SEQ:
        for i, s in enumerate(sig[2]):
            yield from _walk(s, f"{path}[{i}]")
    elif sig[0] == _MAP:
        for k, s in zip(sig[2], sig[3]):
            yield from _walk(s, f"{path}[{k!r}]")


def _show(sig: Signature) -> str:
    tag = sig[0]
    if tag == _TENSOR:
        return f"a tensor of shape {tuple(sig[1])}, {sig[2]}, on {sig[3]}, requires_grad={sig[4]}"
    if tag == _CONST:
        value = float.fromhex(sig[2]) if sig[1] is float else sig[2]
        return f"{value!r} ({sig[1].__name__})"
    if tag == _SEQ:
        return f"a {sig[1].__name__} of {len(sig[2])} entries"
    if tag == _MAP:
        return f"a {sig[1].__name__} with keys {list(sig[2])}"
    return f"a {sig[1].__module__}.{sig[1].__qualname__} object"


def _first_change(old: Signature, new: Signature, path: str) -> Optional[str]:
    if old == new:
        return None
    if old[0] != new[0] or old[1] != new[1] or old[0] in (_TENSOR, _CONST, _OPAQUE):
        return f"`{path}` was {_show(old)} at capture, now {_show(new)}"
    if old[0] == _SEQ:
        if len(old[2]) != len(new[2]):
            return f"`{path}` was {_show(old)} at capture, now {_show(new)}"
        for i, (a, b) in enumerate(zip(old[2], new[2])):
            found = _first_change(a, b, f"{path}[{i}]")
            if found:
                return found
    else:  # _MAP
        if old[2] != new[2]:
            return f"`{path}` had keys {list(old[2])} at capture, now {list(new[2])}"
        for k, a, b in zip(old[2], old[3], new[3]):
            found = _first_change(a, b, f"{path}[{k!r}]")
            if found:
                return found
    return None


def describe_change(old: Signature, new: Signature, names: Sequence[str] = ()) -> str:
    """Name the first argument whose structure, constant or tensor metadata differs between two call signatures."""
    a, b = dict(_top(old, names)), dict(_top(new, names))
    if list(a) != list(b):
        gone, added = [k for k in a if k not in b], [k for k in b if k not in a]
        if gone or added:
            return (f"the arguments changed: {'missing ' + str(gone) if gone else ''}"
                    f"{', ' if gone and added else ''}{'new ' + str(added) if added else ''} "
                    f"(captured with {list(a)})")
        return f"the keyword arguments came in another order: {list(b)} (captured with {list(a)})"
    for k in a:
        found = _first_change(a[k], b[k], k)
        if found:
            return found
    return "the call's signature changed"  # unreachable when old != new


# ---------------------------------------------------------------------------------------------- recording, checks


def record_call(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[torch.Tensor, ...], Signature]:
    """Sample args of one eager call: detached clones of its tensor leaves (``requires_grad`` kept) and its signature.

    Never raises for unsupported objects (it runs in a forward-pre hook, mid-step); :func:`check_signature`
    refuses them at capture.
    """
    leaves, sig = flatten((args, kwargs))
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in leaves), sig


def check_signature(name: str, sig: Signature, fn: Callable[..., Any]) -> None:
    """Refuse, before capture, a recorded call that a graph cannot bind: raises TypeError naming the argument.

    ``fn`` is the callable's forward (for parameter names). Rules: every leaf is a tensor or a constant,
    inside tuples, lists, namedtuples or dicts; a rebuilt call must flatten to the same signature.
    """
    names = arg_names(fn)
    bad = [(path, s[1]) for top, s0 in _top(sig, names) for path, s in _walk(s0, top) if s[0] == _OPAQUE]
    if bad:
        shown = ", ".join(f"`{p}` ({c.__module__}.{c.__qualname__})" for p, c in bad)
        raise TypeError(
            f"graphed callable {name} was called with arguments a CUDA graph cannot bind: {shown}. A graphed "
            "call may hold tensors (graph inputs) and constants (None, bool, int, float, str, dtype, device, "
            "enum; bound at capture), nested in tuples, lists and dicts. Pass such objects as tensors or "
            "constants (a KV cache, e.g. HuggingFace's DynamicCache: train with use_cache=False), or select a "
            "scope that does not receive them (cuda_graph_module_patterns)"
        )
    leaves = [torch.empty(0)] * sum(1 for _, s in _walk(sig, "") if s[0] == _TENSOR)
    again = flatten(rebuild(sig, leaves))[1]
    if _strip(again) != _strip(sig):
        raise TypeError(
            f"graphed callable {name}: its arguments do not survive flatten and rebuild ({describe_change(sig, again, names)}); "
            "pass plain tuples, lists, dicts or namedtuples, or select another scope"
        )


def check_recorded(callables: Sequence[Any]) -> None:
    """:func:`check_signature` for every recorded callable (objects with ``name``, ``signature``, ``module``)."""
    for c in callables:
        if c.signature is not None:
            check_signature(c.name, c.signature, c.module.forward)


def call_with(fn: Callable[..., Any], first: Any, batch: Any) -> Any:
    """``fn(first, **batch)`` for a dict, ``fn(first, *batch)`` for a tuple or list, else ``fn(first, batch)``."""
    if isinstance(batch, dict):
        return fn(first, **batch)
    if isinstance(batch, (tuple, list)):
        return fn(first, *batch)
    return fn(first, batch)


def _strip(sig: Signature) -> Any:
    """A signature without tensor metadata (for structural comparisons)."""
    if sig[0] == _TENSOR:
        return (_TENSOR,)
    if sig[0] == _SEQ:
        return (_SEQ, sig[1], tuple(_strip(s) for s in sig[2]))
    if sig[0] == _MAP:
        return (_MAP, sig[1], sig[2], tuple(_strip(s) for s in sig[3]))
    return sig


# ---------------------------------------------------------------------------------------------- capture


class CallWrapper(nn.Module):
    """What the graph maker captures for one callable: ``forward(*tensors) -> tuple of tensors``.

    Holds the original module as its only child (so ``parameters()`` are the module's, in the same order),
    rebuilds the recorded call around the given tensors, calls the module's own forward (``fwd``, an
    instance override included; never ``__call__``), checks that the call did not modify an argument in
    place (a graph would modify its static copy instead), and returns the output's tensors, remembering
    the output's structure in ``out_sig``. Used only during warmup and capture (and by the protocol
    backend's replays); the module's hooks are off at that time.
    """

    def __init__(self, module: nn.Module, name: str, sig: Signature, fwd: Callable[..., Any]) -> None:
        # The graph maker checks the wrapper for hooks; what it would have refused on the module is checked
        # here, since the wrapper calls the module's forward and would silently skip such hooks.
        left = {d: len(getattr(module, d)) for d in _HOOK_DICTS if getattr(module, d)}
        if left:
            raise RuntimeError(
                f"graphed callable {name} still has hooks {left} when handed to the graph maker; modules must not "
                "have hooks registered at the time they are captured (capture-time hooks run outside the capture)"
            )
        super().__init__()
        self.inner = module
        self.callable_name = name
        self.sig = sig
        self.out_sig: Optional[Signature] = None
        self.eager_forward = fwd
        self._names = arg_names(fwd)
        self.training = module.training  # graph makers compare this with the mode at replay

    def forward(self, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        args, kwargs = rebuild(self.sig, tensors)
        versions = [_version(t) for t in tensors]
        out = self.eager_forward(*args, **kwargs)
        changed = [i for i, (t, v) in enumerate(zip(tensors, versions)) if v is not None and _version(t) != v]
        if changed:
            raise NotImplementedError(
                f"graphed callable {self.callable_name} modifies its argument {self._leaf_names()[changed[0]]} in "
                "place; replay would modify the graph's static copy, not the caller's tensor. Make the module "
                "work out of place, or select a scope that does not include this operation"
            )
        leaves, out_sig = flatten(out)
        bad = [(p, s[1]) for p, s in _walk(out_sig, "output") if s[0] == _OPAQUE]
        if bad:
            raise NotImplementedError(
                f"graphed callable {self.callable_name} returned `{bad[0][0]}` of type "
                f"{bad[0][1].__module__}.{bad[0][1].__qualname__}, which a graph cannot return; outputs "
                "may be tensors and constants in tuples, lists, dicts and ModelOutput-like objects. Select another "
                "scope"
            )
        if _strip(flatten(rebuild(out_sig, leaves))[1]) != _strip(out_sig):
            raise NotImplementedError(
                f"graphed callable {self.callable_name} returns a {type(out).__qualname__} that cannot be rebuilt "
                "from its fields; return tuples, dicts or dataclass-like mappings, or select another scope"
            )
        if self.out_sig is not None and _strip(out_sig) != _strip(self.out_sig):
            raise RuntimeError(
                f"graphed callable {self.callable_name} returned differently structured outputs in two calls with "
                f"the same arguments ({_show(self.out_sig)} then {_show(out_sig)}); a graph binds one structure"
            )
        self.out_sig = out_sig
        return tuple(leaves)

    def _leaf_names(self) -> List[str]:
        return [f"`{p}`" for top, s0 in _top(self.sig, self._names) for p, s in _walk(s0, top) if s[0] == _TENSOR]


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None


# ---------------------------------------------------------------------------------------------- replay


class Dispatcher:
    """A graphed module's ``forward`` after capture: replay when the call matches capture, else run eagerly.

    Args:
        module: the original module (its ``training`` flag is compared with capture's).
        name: the callable's qualified name, for messages.
        graphed: ``f(*tensors) -> tuple of tensors`` (the graph maker's forward of the :class:`CallWrapper`).
        wrapper: the :class:`CallWrapper` (call and output signatures of capture).
        eager: the module's own forward before capture (called with the original arguments on a mismatch).
        strict: raise ValueError on a mismatch instead of running eagerly.
        on_replay: called before each replay (the engine learns which graphs wrote gradients outside Python:
            [Note: fused weight gradients] in ``megatron_fsdp/_fused_wgrad.py``).
        replay_kwargs: called at each replay for keyword arguments the graph maker's forward takes besides the
            tensors (TE's ``is_first_microbatch`` with FP8 weight caching, ``capture/fp8.py``); None: none.

    Counters ``replays`` and ``eager_calls`` say what happened; ``last_change`` holds the last mismatch's
    description. The hot path is one flatten and one tuple comparison.
    """

    def __init__(self, module: nn.Module, name: str, graphed: Callable[..., Any], wrapper: CallWrapper,
                 eager: Callable[..., Any], *, strict: bool = False,
                 on_replay: Optional[Callable[[], None]] = None,
                 replay_kwargs: Optional[Callable[[], Dict[str, Any]]] = None) -> None:
        assert wrapper.out_sig is not None, "the wrapper never ran: no output signature"
        self.module = module
        self.name = name
        self.graphed = graphed
        self.wrapper = wrapper
        self.sig = wrapper.sig
        self.out_sig = wrapper.out_sig
        self._single = wrapper.out_sig[0] == _TENSOR
        self.training = module.training
        self.eager = eager
        self.strict = strict
        self.on_replay = on_replay
        self.replay_kwargs = replay_kwargs
        self.replays = 0
        self.eager_calls = 0
        self.warned = False
        self.last_change: Optional[str] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves: List[torch.Tensor] = []
        sig = _flatten((args, kwargs), leaves)
        if sig == self.sig and self.module.training == self.training:
            self.replays += 1
            if self.on_replay is not None:
                self.on_replay()
            out = self.graphed(*leaves, **self.replay_kwargs()) if self.replay_kwargs is not None else self.graphed(*leaves)
            if self._single:
                return out[0] if isinstance(out, (tuple, list)) else out
            return rebuild(self.out_sig, out if isinstance(out, (tuple, list)) else (out,))
        return self._mismatch(sig, args, kwargs)

    def _mismatch(self, sig: Signature, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if self.module.training == self.training:  # else: another mode than at capture, eager as graph makers do
            change = describe_change(self.sig, sig, arg_names(self.eager))
            self.last_change = change
            if self.strict:
                raise ValueError(
                    f"graphed callable {self.name} was called differently than at capture: {change}. "
                    "cuda_graph_strict_signature=True refuses such calls; call it as at capture, set "
                    "cuda_graph_strict_signature=False to run such calls eagerly, or delete() the graphs and "
                    "capture again with the new call"
                )
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"fsdp_cudagraph: graphed callable {self.name} was called differently than at capture: "
                    f"{change}; this call and any other such call of {self.name} run eagerly (warned once per "
                    "callable; cuda_graph_strict_signature=True raises instead)",
                    SignatureChangedWarning,
                    stacklevel=3,
                )
        self.eager_calls += 1
        return self.eager(*args, **kwargs)


def eager_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's forward as an eager call runs it: a training graph's :class:`Dispatcher` stands aside."""
    fwd = module.forward
    return fwd.eager if isinstance(fwd, Dispatcher) else fwd

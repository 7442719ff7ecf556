"""Static-schedule steps: what the engine promises a layer that captures whole training steps in a graph.

A CUDA graph of a whole step (forward and backward over all micro-batches, collectives inside) replays
kernels; no Python runs. Every decision the engine takes from host state while the step is captured is
therefore frozen into the graph, and replays must start from the state that capture started from. This
module is the engine's side of that contract, one object per model, :class:`StaticStep`: a fixed starting state
(:meth:`StaticStep.begin_static_step`), the host state after a replay (:meth:`StaticStep.end_static_step`), the
preconditions (:meth:`StaticStep.require_fixed_buffers`), and what a whole-step graph needs around it (the
process group, its backend, the capture guard, the clipping). The graph layer (``fsdp_cudagraph``) reaches it
through its ``megatron_fsdp`` adapter, which hands this object over as the engine's ``StaticStepEngine`` (its
method names are that contract's; this package does not import ``fsdp_cudagraph``, so the adapter registers the
class as a virtual subclass), and never touches unit internals itself.

[Note: the static schedule]
The decisions an eager step takes from host state, and how a static step fixes each:

- ``_install_if_stale`` casts (and for ``optim``/``optim_grads`` all-gathers) the main shard into the compute
  parameters only when the shard's version counter moved; for ZeRO-3 it marks the gathered data invalid, and
  the next gather casts from the main shard ([Note: cast on gather], ``_unit.py``). A captured step must always do it, because the
  optimizer runs between replays; and a graphed optimizer step changes the shards without moving the
  counters at all. :meth:`~StaticStep.begin_static_step` marks every unit stale, so capture records the install;
  :meth:`~StaticStep.end_static_step` marks them stale again, so that an eager step after a replay re-installs too.
- ``unshard`` skips the all-gather when the unit's slot still holds its data (``data_valid``, slot owner).
  A static step starts with no slot owned and no ZeRO-3 unit valid: capture records every gather the step
  needs, and the skips it records (the last unit of forward reusing its slot in backward) refer to data
  gathered earlier in the same graph.
- ``_reduce_grads`` writes the first micro-batch's reduction into ``main_grad`` and adds the later ones,
  choosing by ``main_shard.grad is None``. A static step starts with every ``main_shard.grad`` unbound, so
  the graph overwrites the main gradients with this step's: a static step replaces gradients, like an eager
  step after ``optimizer.zero_grad()``.
- ``retire`` binds ``main_shard.grad = main_grad``; a replay runs no Python, so ``end_static_step``
  binds the units that capture bound (``grads_bound``) and unbinds the others, exactly as an eager step
  would leave them, whatever ``zero_grad(set_to_none=True)`` did in between. The main gradients the
  capture created (in the graph's pool) must outlive every ``zero_grad``: ``keep_main_grads``, right
  after capture ([Note: main gradients live like .grad], ``_unit.py``).
- Slot owners, unit states, pending collectives: after a replay they are reset to "nothing valid, nothing
  in flight", which is always safe for the next eager step (at worst it gathers a unit once more).

Buffers must not move between capture and replay: on-demand buffers (ZeRO-3 or ``optim_grads`` without
``fsdp_double_buffer`` and ``fsdp_db_use_persist_buf_on_alloc_fail``) are refused. Tensors that the step
allocates through PyTorch's allocator while it is captured come from the graph's private pool and keep
their addresses.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._clip import bind_no_gradient
from ._common import COMPUTING, CaptureGuardMode, TrainingState, capture_guard

if TYPE_CHECKING:
    from ._fully_shard import MegatronFSDP

__all__ = ["StaticStep", "static_buffer_problems", "PER_LAYER_ROLES"]

#: The buffers a per-layer or whole training step's replay touches ([Note: fixed addresses] in fsdp_cudagraph).
PER_LAYER_ROLES = ("unshard", "gradient")


def static_buffer_problems(engine: "MegatronFSDP", roles: Sequence[str] = PER_LAYER_ROLES) -> List[str]:
    """The buffers of ``roles`` that a step allocates on demand (and frees), e.g. ``"unshard buffer of unit layers.0"``."""
    out = []
    for u in engine.all_units():
        for role, buf in (("unshard", u.param_buffer), ("gradient", u.grad_buffer)):
            if role in roles and buf is not None and buf.kind == "dynamic":
                out.append(f"{role} buffer of unit {u.name}")
    return out


class StaticStep:
    """One :class:`MegatronFSDP` model's static step: what a graph of a whole step asks of the engine.

    Lifecycle: :meth:`require_fixed_buffers` when the graph is built; :meth:`begin_static_step` before a capture
    and before every eager step standing in for a replay; :meth:`grads_bound` right after capture and
    :meth:`keep_main_grads` for a training step; :meth:`quiesce` and :meth:`end_static_step` around every
    replay; :meth:`release_main_grads` when the graph is deleted. Holds nothing but the model: build one
    whenever needed.
    """

    def __init__(self, engine: "MegatronFSDP") -> None:
        self.engine = engine

    # -- preconditions and what a whole-step graph needs around it
    def require_fixed_buffers(self, graph_kind: str, buffers: Sequence[str] = PER_LAYER_ROLES) -> None:
        """Raise ValueError naming the units whose buffers of ``buffers`` are allocated on demand.

        The engine's one phrasing of the address rule (a graph needs fixed addresses): ``buffers`` are the ones a
        replay of the caller's graph (``graph_kind``, named in the message) touches, ``("unshard",)`` for a
        forward-only graph.
        """
        engine, roles = self.engine, tuple(buffers)
        problems = static_buffer_problems(engine, roles)
        if problems:
            shown = ", ".join(problems[:4]) + (f" and {len(problems) - 4} more" if len(problems) > 4 else "")
            subject = "the parameters" if "gradient" not in roles else "the parameters and gradients"
            which = "every unshard buffer" if "gradient" not in roles else "every engine buffer"
            raise ValueError(
                f"{graph_kind} needs {subject} at fixed addresses ({which}), but with sharding_strategy="
                f"'{engine.strategy.value}', fsdp_double_buffer={engine.fsdp_double_buffer} and "
                f"fsdp_db_use_persist_buf_on_alloc_fail={engine.fsdp_db_use_persist_buf_on_alloc_fail} the {shown} "
                "are allocated on demand; pass fsdp_double_buffer=True and fsdp_db_use_persist_buf_on_alloc_fail=True "
                "to fully_shard (or use sharding_strategy 'no_shard' or 'optim', whose buffers are persistent)"
            )

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def process_group(self) -> Any:
        """The group a whole-step graph's collectives run in, all of whose ranks capture together.

        Under HSDP the graph holds the all-reduce across replicas too, so every data-parallel rank captures and
        agrees together: the world, when it is exactly the R x S ranks (NotImplementedError otherwise).
        """
        engine = self.engine
        if engine.hsdp.hybrid:
            if dist.get_world_size() != engine.dp_world_size:
                raise NotImplementedError(
                    f"[rank {engine.rank}] a whole-step graph of a model under hybrid sharding needs the "
                    f"data-parallel ranks (replicate {engine.hsdp.replicate_size} x shard {engine.world_size} = "
                    f"{engine.dp_world_size}) to be the whole world ({dist.get_world_size()} ranks), so that they "
                    "capture together; use per-layer graphs or a world of only data-parallel ranks")
            return dist.group.WORLD
        if getattr(engine, "tp_topology", None) is not None:
            # [Note: tensor parallelism] in _tensor.py: the graph holds the model's TP collectives and the engine's TP
            # sums too, so every rank of the (dp, tp) grid, which tiles the world, captures and agrees together.
            return dist.group.WORLD
        return engine.group

    @property
    def collective_backend(self) -> str:
        return self.engine.backend

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def static_capture_guard(self, *, allow_collectives: bool, collective_log: Optional[List[str]] = None
                             ) -> ContextManager[None]:
        """The engine's capture guard: collectives captured when ``allow_collectives``, refused otherwise."""
        mode = CaptureGuardMode.ALLOW_COLLECTIVES if allow_collectives else CaptureGuardMode.REFUSE
        return capture_guard(mode, collective_log=collective_log)

    def clip_grad_norm(self) -> Optional[Callable[[float], torch.Tensor]]:
        """The engine's global-norm clipping (``MegatronFSDP.clip_grad_norm_``)."""
        return getattr(self.engine, "clip_grad_norm_", None)

    # -- the schedule ([Note: the static schedule])
    def quiesce(self) -> None:
        """Wait for the engine's collectives in flight and bring every unit to IDLE, if anything is mid-step.

        Before a replay: an eager all-gather or reduce-scatter still in flight would race with the graph on the
        same buffers. Cheap when nothing is pending (a scan of the units).
        """
        engine = self.engine
        busy = bool(engine._pending) or any(
            u.pending_ag is not None or u.state in COMPUTING or u.state is TrainingState.FORWARD_DONE
            for u in engine.all_units()
        )
        if busy:
            engine.reset_step_state()

    def begin_static_step(self, *, replace_grads: bool = True) -> None:
        """Put the host state at the fixed start of a static step (see [Note: the static schedule]).

        Call before capturing a step, and before every eager step that stands in for a replay (warmup, a
        fallback), so that both follow the schedule the graph froze. Waits for anything in flight first.
        ``replace_grads=False`` for a forward-only (evaluation) step: gradient bindings stay as they are.
        """
        engine = self.engine
        engine.reset_step_state()  # every unit marked stale: its next unshard re-installs from the shards
        shards_params = engine.strategy.shards_params
        for u in engine.all_units():
            if shards_params:
                u.data_valid = False
            if replace_grads:
                u.main_shard.grad = None
        engine.slot_owner[:] = [None] * len(engine.slot_owner)

    def grads_bound(self) -> FrozenSet[str]:
        """Names of the units whose ``main_shard.grad`` is bound to their main gradient (those a step reduced)."""
        return frozenset(u.name for u in self.engine.all_units()
                         if u.main_shard.grad is not None and u.main_shard.grad is u.main_grad)

    def keep_main_grads(self) -> None:
        """Hold the units' current main gradients from now on: a captured step writes them at fixed addresses.

        Call right after capturing a training step. Until then a main gradient lives like ``.grad`` (freed by
        ``zero_grad(set_to_none=True)``, made anew by the next step, see [Note: main gradients live like .grad]);
        after it every reduction, eager or replayed, writes into the kept one, which :meth:`end_static_step` binds.
        """
        for u in self.engine.all_units():
            u.keep_main_grad()
        self.engine.main_grad_keepers += 1

    def release_main_grads(self) -> None:
        """The captured step that :meth:`keep_main_grads` was called for is gone (its graph deleted).

        When no other captured step keeps them, the main gradients live like ``.grad`` again, so the graph's pool
        can be given back once they are unbound.
        """
        engine = self.engine
        if engine.main_grad_keepers <= 0:
            raise RuntimeError("release_main_grads() without a matching keep_main_grads(); call it once per captured "
                               "training step whose graph is deleted")
        engine.main_grad_keepers -= 1
        if engine.main_grad_keepers == 0:
            for u in engine.all_units():
                u.release_main_grad()

    def end_static_step(self, *, bound: Iterable[str]) -> None:
        """Make the host state consistent with a replayed static step (the replay ran no Python).

        ``bound``: the units whose main gradients the step wrote (:meth:`grads_bound` right after capture);
        their ``main_shard.grad`` is bound, every other unit's is unbound. Units end IDLE with nothing valid in
        the slots and parameters marked stale, so an eager step afterwards gathers and installs what it needs.
        For an evaluation graph (no gradients) pass the bindings as they were before the replay.
        """
        engine = self.engine
        names = frozenset(bound)
        shards_params = engine.strategy.shards_params
        for u in engine.all_units():
            u.state = TrainingState.IDLE
            u.pending_ag = None
            u.mark_stale()
            if shards_params:
                u.data_valid = False
            for p in u.params:
                p.grad = None
            u.main_shard.grad = u.main_grad if u.name in names else None
        engine.slot_owner[:] = [None] * len(engine.slot_owner)
        engine._pending.clear()
        engine._callback_queued = False
        if names:  # as an eager backward leaves them ([Note: compute parameters hold no gradient] in _clip.py)
            bind_no_gradient(engine)

    @contextlib.contextmanager
    def recording_phases(self) -> Iterator[List[Tuple[str, str, bool]]]:
        """Record the engine's unit phases in the block: yields a list of ``(phase, unit name, capturing)``.

        What the protocol backend compares between capture and replay. The previous recording (if any) is
        restored in ``finally``, so recordings nest.
        """
        engine = self.engine
        previous = engine.trace
        engine.trace = []
        try:
            yield engine.trace
        finally:
            engine.trace = previous

    def mark_params_stale(self) -> None:
        """Make every unit re-install its compute parameters before its next eager use.

        After a graphed optimizer step: the replay changed the main shards without moving their version
        counters, so the eager version check would not see the update.
        """
        for u in self.engine.all_units():
            u.mark_stale()

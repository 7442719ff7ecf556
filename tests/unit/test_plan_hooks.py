"""A unit's handlers, planned onto the callables inside it, run on the unit (``capture/schedules.plan_hooks``).

Two callables inside one unit (``attn`` and ``mlp`` of a layer): the unit's forward-pre and backward hooks go to
the first, its forward and backward-pre hooks to the last, and each is called with the *unit* whatever module
the graph maker hands it. NVIDIA Megatron-FSDP's ``_post_forward`` asserts that it was given an FSDP unit (seen
on an H100 with megatron-core's GPTModel and the ``attn mlp`` scopes) and releases that module's bucket.
"""

from __future__ import annotations

import types

from torch import nn

from fsdp_cudagraph.capture.schedules import plan_hooks

KEYS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


def test_unit_handlers_run_on_the_unit():
    unit = nn.Module()
    unit.attn, unit.mlp = nn.Linear(2, 2), nn.Linear(2, 2)
    called = []

    def handler(key):
        return lambda module: called.append((key, module))

    def callable_of(module):
        return types.SimpleNamespace(module=module, unit=unit,
                                     extracted=types.SimpleNamespace(capture_time={k: {} for k in KEYS}))

    first, last = callable_of(unit.attn), callable_of(unit.mlp)
    plan_hooks([first, last], lambda u: {k: {i: handler(k)} for i, k in enumerate(KEYS)})
    where = {k: [c for c in (first, last) if c.plan[k]] for k in KEYS}
    assert where == {"forward_pre_hooks": [first], "forward_hooks": [last], "backward_pre_hooks": [last],
                     "backward_hooks": [first]}, where
    for k in KEYS:
        c = where[k][0]
        for fn in c.plan[k].values():
            fn(c.module)  # as TE's capture_time_hooks call them: with the callable's module
    assert [k for k, _ in called] == list(KEYS)
    assert all(m is unit for _, m in called), [type(m).__name__ for _, m in called]

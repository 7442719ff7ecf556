"""Probe TransformerEngine once, at import.

Everything in the package that needs TE asks this module instead of importing TE itself, so that the
absence of TE is discovered in one place and explained with one reason string (which tests reuse in their
skip messages).

[Note: two cuDNNs in one process]
Two loaders decide which cuDNN TE runs. TE's import opens ``libcudnn`` from ``CUDNN_HOME`` or ``CUDNN_PATH``, else
from the first of ``CUDA_HOME``, ``CUDA_PATH`` and ``/usr/local/cuda`` that holds one (a recursive search), and only
then by name from the library path (``transformer_engine/common/__init__.py``, TE 2.20); cuDNN then opens its parts
(``libcudnn_graph``, ``libcudnn_engines_*``, ...) by name from the library path. On machines with a system cuDNN
(9.14) beside torch's pip one (9.19) three mixes were seen (H200, 2026-11-29): with ``CUDNN_PATH`` at torch's cuDNN
alone, the system's parts came in beside torch's ``libcudnn.so.9`` and torch raised "cuDNN version incompatibility"
when asked for its version; with torch's directory first on ``LD_LIBRARY_PATH`` alone and no ``CUDNN_PATH``, TE
opened the system's 9.14 (it asks for ``libcudnn.so`` by name; torch's directory holds only ``libcudnn.so.9``)
while torch reported its own 9.19, and TE's attention ran its unfused softmax
kernels (the 8B-shaped bench's FP8 step at 4 layers and 8 micro-batches: 1.82 s, against 0.98 s fused); with
both, TE and torch ran 9.19.
Nothing fails at import, so the probe asks torch for its version and compares TE's with it once TE is in, and warns
with :data:`CUDNN_FIX`. (``CUDNN_PATH`` set to the empty string makes TE's search walk the whole file system.)
docs/fp8.md, "Which cuDNN runs".
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Tuple

from packaging.version import Version

__all__ = ["HAS_TE", "TE_REASON", "TE_VERSION", "MIN_TE_VERSION", "require_te", "te_pytorch", "cudnn_mismatch",
           "te_cudnn_version", "CUDNN_FIX"]

#: Oldest TE whose ``make_graphed_callables`` accepts ``capture_time_hooks``.
MIN_TE_VERSION = Version("2.19")

TE_VERSION: Optional[Version] = None
te_pytorch: Any = None
HAS_TE = False
TE_REASON = ""

try:  # pragma: no cover - depends on the machine
    import transformer_engine as _te
    import transformer_engine.pytorch as _te_pytorch

    TE_VERSION = Version(_te.__version__.split("+")[0])
    if TE_VERSION < MIN_TE_VERSION:
        TE_REASON = (
            f"TransformerEngine {TE_VERSION} is installed, but capture_time_hooks needs >= {MIN_TE_VERSION}; "
            "upgrade with: pip install 'fsdp-cudagraph[te]'"
        )
    else:
        te_pytorch = _te_pytorch
        HAS_TE = True
except Exception as exc:  # ImportError, or a TE build that fails to load its library
    TE_REASON = (
        f"TransformerEngine is not importable ({type(exc).__name__}: {exc}); "
        "install it with: pip install 'fsdp-cudagraph[te]'"
    )


#: How to give TE torch's cuDNN: TE opens ``libcudnn`` from ``CUDNN_PATH`` (else ``CUDA_HOME``, ``/usr/local/cuda``)
#: before the library path, and cuDNN opens its parts by name from the library path; both before Python starts.
CUDNN_FIX = ("point TE and the library path at torch's cuDNN before Python starts: export "
             "CUDNN_PATH=$(python -c \"import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])\") "
             "LD_LIBRARY_PATH=$CUDNN_PATH/lib:$LD_LIBRARY_PATH (docs/fp8.md, 'Which cuDNN runs')")


def te_cudnn_version() -> Optional[Tuple[int, ...]]:
    """The cuDNN version TE runs (``transformer_engine.pytorch.utils.get_cudnn_version``), or None without TE."""
    if not HAS_TE:
        return None
    from transformer_engine.pytorch.utils import get_cudnn_version  # pragma: no cover - needs TE

    return tuple(int(v) for v in get_cudnn_version())  # pragma: no cover - needs TE


def cudnn_mismatch(te_cudnn: Optional[Sequence[int]] = None) -> Optional[str]:
    """What is wrong with the cuDNN in this process ([Note: two cuDNNs in one process]) with the fix, or None.

    Two ways were seen: torch raises its version incompatibility (its ``libcudnn.so.9`` beside another cuDNN's
    parts), or torch reports its own version while TE runs another (``te_cudnn``: TE's, asked of TE when not
    given), in which case TE's attention ran unfused, without a word of its own.
    """
    import torch

    try:
        ours = torch.backends.cudnn.version()
    except RuntimeError as exc:
        text = str(exc)
        if "cuDNN version incompatibility" not in text:
            return None
        return (f"{text.split('. ')[0]}: this process holds parts of two cuDNNs (TE's import loads the ones it finds "
                f"on the library path); {CUDNN_FIX}")
    te_cudnn = te_cudnn if te_cudnn is not None else te_cudnn_version()
    if ours is None or te_cudnn is None:
        return None
    torch_cudnn = (ours // 10000, ours // 100 % 100, ours % 100)
    if tuple(te_cudnn)[:3] == torch_cudnn:
        return None
    return (f"TE runs cuDNN {'.'.join(map(str, te_cudnn))} and torch cuDNN {'.'.join(map(str, torch_cudnn))}: this "
            "process holds two cuDNNs (TE's import loads the one it finds on the library path), and TE may then "
            f"fall back to its unfused attention without a word; {CUDNN_FIX}")


if HAS_TE:  # pragma: no cover - depends on the machine
    _mismatch = cudnn_mismatch()
    if _mismatch:
        warnings.warn(f"fsdp_cudagraph: {_mismatch}", RuntimeWarning, stacklevel=2)


def require_te(what: str) -> Any:
    """Return ``transformer_engine.pytorch`` or raise ImportError saying what needed it and how to get it."""
    if not HAS_TE:
        raise ImportError(f"{what} needs TransformerEngine >= {MIN_TE_VERSION}: {TE_REASON}")
    return te_pytorch

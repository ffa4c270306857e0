"""Programmatic dependent launch (PDL, sm_90+) between the decode step's Triton kernels.

A decode step is a chain of short kernels (norm, GEMV, rotary + KV store, attention, GEMV, ...),
each waiting for the one before. Launched with PDL, a kernel's programs start while the kernel
before it drains, run what does not depend on it (a GEMV's first weight loads), then wait for it
at `griddepcontrol.wait`. Each kernel lets its dependents start as soon as all its programs are
running (`griddepcontrol.launch_dependents`, before its own wait): a GEMV two kernels down the chain
can have its programs resident and its first weights in flight while a norm between waits. The
wait orders a kernel after the whole of the one before, and so (each of them waiting in turn)
after every earlier kernel. CUDA graphs keep these edges.

    kernel A:  [ programs ....................... ]
    kernel B:            [ weights | wait ..........][ x, math, stores ]   (B launched with PDL)

Rule for a kernel with a `PDL` constexpr: `wait_before_reads(PDL)` (or its two calls) comes before
its first load of anything an earlier kernel writes and before its first store; only what no
kernel of the step writes (weights) may be loaded before it. Kernels launched without PDL (torch's,
cuBLAS) are ordered as usual; a PDL kernel after one of them starts when it finishes.

ENABLED: the switch (environment KVTIER_PDL=0 turns it off); `launch_args` gives a launch its
PDL constexpr and launch option, off where the device or Triton lacks it and under the interpreter.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # no Triton, or one before 3.3: launch_args keeps PDL off
    HAVE_GDC = False

ENABLED = os.environ.get("KVTIER_PDL", "1") != "0"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def launch_args(device: torch.device, want: bool | None = None) -> dict:
    """A kernel launch's {"PDL": ..., "launch_pdl": ...}: on where wanted (default ENABLED), the
    device is sm_90+ and Triton has griddepcontrol; else {"PDL": False}."""
    on = (ENABLED if want is None else want) and HAVE_GDC and not INTERPRETED and _capability(device) >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0


if HAVE_TRITON:
    @triton.jit
    def wait_before_reads(PDL: tl.constexpr):
        """Let the next kernel start (its programs wait in turn), then wait for the kernel before
        (its writes are visible after this). A constexpr branch: PDL False compiles to nothing."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

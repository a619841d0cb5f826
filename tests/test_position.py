"""data/position.py: the per-read-unit resume state (pure, no Ray)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ray_mmbatch.data.position import DataPosition, EpochPosition, encode_positions


def test_units_finish_and_only_units_in_flight_keep_row_bitmaps():
    ep = EpochPosition()
    ep.add(encode_positions([0, 0, 1], [0, 1, 2]), [3, 3, 4])
    assert not ep.unit_finished(0) and set(ep.in_flight) == {0, 1}
    ep.add(encode_positions([0], [2]), [3])  # idempotent adds, unit 0 complete
    ep.add(encode_positions([0, 1], [2, 2]), [3, 4])
    assert ep.unit_finished(0) and set(ep.in_flight) == {1}
    assert ep.contains(encode_positions([0, 1, 1, 5], [1, 2, 0, 0])).tolist() == [True, True, False, False]
    assert ep.rows_to_read(0, 3).tolist() == [False] * 3
    assert ep.rows_to_read(1, 4).tolist() == [True, True, False, True]
    assert ep.rows_to_read(7, 2) is None
    ep.add([-1], [0])  # rows without a read position are ignored
    assert ep.contains([-1]).tolist() == [False]


def test_state_round_trips_and_stays_small():
    dp = DataPosition()
    rng = np.random.default_rng(0)
    for u in range(2000):  # 2000 finished units of 100 rows, out of order
        dp.add(0, encode_positions(np.full(100, u), rng.permutation(100)), np.full(100, 100))
    dp.add(0, encode_positions([2500, 2500], [3, 9]), [100, 100])
    dp.add(1, encode_positions([4], [0]), [2])
    state = json.loads(json.dumps(dp.state_dict()))
    assert len(json.dumps(state)) < 1000
    back = DataPosition.from_state(state)
    assert back.state_dict() == state
    assert back.contains(0, encode_positions([1999, 2000, 2500, 2500], [5, 0, 9, 8])).tolist() == [
        True, False, True, False]
    assert back.contains(1, encode_positions([4, 4], [0, 1])).tolist() == [True, False]
    assert back.contains(2, encode_positions([4], [0])).tolist() == [False]
    assert DataPosition.from_state(None).state_dict() == {"version": 1, "epochs": {}}


def test_listing_digest_follows_the_units_not_the_mount_and_a_changed_listing_refuses_resume(tmp_path):
    import shutil

    from ray_mmbatch.config import DataConfig
    from ray_mmbatch.formats.units import check_listing, listing_digest, read_units
    from ray_mmbatch.synthetic.generate import generate_dataset

    generate_dataset(str(tmp_path / "a"), 30, "parquet", seed=1, shard_size=10, workers=1)
    digest = listing_digest(read_units(str(tmp_path / "a"), DataConfig())[0])
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same files elsewhere (another mount, a bucket)
    assert listing_digest(read_units(str(tmp_path / "b"), DataConfig())[0]) == digest
    (tmp_path / "b" / "train-00001-of-00003.parquet").unlink()  # a file gone: the indices shift
    changed = listing_digest(read_units(str(tmp_path / "b"), DataConfig())[0])
    assert changed != digest and changed.startswith("2:") and digest.startswith("3:")

    dp = DataPosition()
    dp.listing = digest
    dp.add(0, encode_positions([0], [1]), [10])
    state = dp.state_dict()
    assert DataPosition.from_state(state).listing == digest
    check_listing(state, digest, "a")  # same listing: resumes
    check_listing({"epochs": {}}, changed, "b")  # a checkpoint from before digests: nothing to compare
    with pytest.raises(ValueError, match=r"read units changed since the checkpoint \(listing 3:.* then, 2:"):
        check_listing(state, changed, "b")

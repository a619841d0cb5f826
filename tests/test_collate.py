"""collate_pack / collate_pad layouts and the no-pickle encode/decode round trip."""
from __future__ import annotations

import numpy as np
import pytest

from ray_mmbatch.batching import collate_pack, collate_pad, decode_batch, encode_batch
from ray_mmbatch.schema import IGNORE_INDEX

D = 3 * 14 * 14
PAD = 0


def make_sample(sid, length, grids, rng, target_from=1):
    """A sample shaped like materialize_sample's output: labels already shifted."""
    ids = rng.integers(5, 1000, length).astype(np.int32)
    labels = np.full(length, IGNORE_INDEX, np.int32)
    labels[target_from:-1] = ids[target_from + 1:]  # labels[t] = ids[t+1]; last is -100
    grids = np.array(grids, np.int32).reshape(-1, 3)
    n_patches = int(np.prod(grids, axis=1).sum()) if len(grids) else 0
    patches = rng.integers(0, 256, (n_patches, D)).astype(np.uint8)
    return {"sample_id": sid, "input_ids": ids, "labels": labels, "patches": patches,
            "grids": grids}


@pytest.fixture
def samples():
    rng = np.random.default_rng(0)
    return [make_sample("a", 7, [[1, 4, 6]], rng), make_sample("b", 3, [], rng),
            make_sample("c", 5, [[1, 2, 2], [1, 4, 4]], rng, target_from=2)]


def test_pack_layout(samples):
    out = collate_pack(samples, PAD)
    assert out["mode"] == "pack"
    assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape == (1, 15)
    assert out["input_ids"].dtype == np.int32
    assert out["cu_seqlens"].tolist() == [0, 7, 10, 15] and out["cu_seqlens"].dtype == np.int32
    assert out["seq_lens"].tolist() == [7, 3, 5] and out["max_seqlen"] == 7
    assert out["position_ids"][0].tolist() == list(range(7)) + list(range(3)) + list(range(5))
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert (labels[out["cu_seqlens"][1:] - 1] == IGNORE_INDEX).all()  # no cross-sample target
    targets = np.flatnonzero(labels != IGNORE_INDEX)
    assert (labels[targets] == ids[targets + 1]).all()
    assert out["real_tokens"] == 15 and out["target_tokens"] == 5 + 1 + 2 == len(targets)
    assert out["sample_ids"] == ["a", "b", "c"]


def test_vision_fields(samples):
    out = collate_pack(samples, PAD)
    assert out["patches"].shape == (24 + 4 + 16, D) and out["patches"].dtype == np.uint8
    assert out["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2], [1, 4, 4]]
    assert out["image_sample_index"].tolist() == [0, 2, 2]
    assert out["vision_cu_seqlens"].tolist() == [0, 24, 28, 44]
    assert (out["patches"][24:28] == samples[2]["patches"][:4]).all()


def test_pad_layout(samples):
    out = collate_pad(samples, pad_id=PAD)
    assert out["mode"] == "pad"
    assert out["input_ids"].shape == (3, 7) and out["attention_mask"].dtype == bool
    assert out["attention_mask"].sum(1).tolist() == [7, 3, 5]
    assert (out["input_ids"][1, 3:] == PAD).all() and (out["labels"][1, 3:] == IGNORE_INDEX).all()
    assert (out["input_ids"][2, :5] == samples[2]["input_ids"]).all()
    assert out["position_ids"][2].tolist() == [0, 1, 2, 3, 4, 0, 0]
    assert out["real_tokens"] == 15 and out["target_tokens"] == 8
    assert out["image_sample_index"].tolist() == [0, 2, 2]


@pytest.mark.parametrize("collate", [collate_pack, collate_pad])
def test_encode_decode_round_trip_is_exact(samples, collate):
    batch = collate(samples, PAD)
    data = encode_batch(batch)
    assert isinstance(data, bytes) and data[:4] == b"MMB1"
    back = decode_batch(data)
    assert back.keys() == batch.keys()
    for k, v in batch.items():
        if isinstance(v, np.ndarray):
            assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
            assert np.array_equal(back[k], v), k
        else:
            assert back[k] == v and type(back[k]) is type(v), k


def test_text_only_batch_has_empty_vision():
    rng = np.random.default_rng(1)
    out = collate_pack([make_sample("t", 4, [], rng)], PAD)
    assert out["patches"].shape == (0, D) and out["image_grid_thw"].shape == (0, 3)
    assert out["vision_cu_seqlens"].tolist() == [0]
    back = decode_batch(encode_batch(out))
    assert back["patches"].shape == (0, D) and back["image_grid_thw"].shape == (0, 3)


def test_bad_samples_are_refused(samples):
    bad = dict(samples[0], labels=samples[0]["labels"].copy())
    bad["labels"][-1] = 7
    with pytest.raises(ValueError, match="last label must be IGNORE_INDEX"):
        collate_pack([bad], PAD)
    with pytest.raises(ValueError, match="grids say"):
        collate_pad([dict(samples[0], grids=np.array([[1, 2, 2]], np.int32))], PAD)
    with pytest.raises(ValueError, match="empty batch"):
        collate_pack([], PAD)
    other = dict(samples[2], patches=samples[2]["patches"][:, :10])
    with pytest.raises(ValueError, match="patch rows differ"):
        collate_pack([samples[0], other], PAD)


def test_decode_refuses_corrupt_or_foreign_bytes(samples):
    data = encode_batch(collate_pack(samples, PAD))
    with pytest.raises(ValueError, match="bad magic"):
        decode_batch(b"\x80\x04" + data[2:])  # a pickle header is not accepted
    with pytest.raises(ValueError, match="does not match the payload"):
        decode_batch(data[:-64])
    with pytest.raises(TypeError, match="cannot serialize"):
        encode_batch({"x": {"nested": 1}})
    with pytest.raises(TypeError, match="not serializable"):
        encode_batch({"x": np.array([object()])})


def test_empty_array_last_and_scalars_round_trip():
    batch = {"n": np.int64(3), "ok": True, "f": 0.5, "empty": np.zeros((0, 3), np.int32)}
    back = decode_batch(encode_batch(batch))
    assert back["n"] == 3 and back["ok"] is True and back["f"] == 0.5
    assert back["empty"].shape == (0, 3) and back["empty"].dtype == np.int32

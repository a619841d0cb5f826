"""Small inputs must not exhaust memory (issue 15): each limit is checked before the bytes are read or
decoded. Every case is built here, run through the in-process data path (local_batches) in a child
process, and its peak RSS compared with a clean run of the same set without the hostile sample."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ray_mmbatch import schema as S
from tests.test_bad_data import CONV, png  # the same good sample as the bad-data tests

GOOD = 6
SLACK_MB = 200  # the hostile runs' peaks were 1-9 GB above a clean run before the limits

_CHILD = r"""
import json, resource, sys
from tests.test_bad_data import trained_and_skipped
trained, skipped = trained_and_skipped(sys.argv[1], oversize=sys.argv[2])
print(json.dumps({"trained": trained, "skipped": skipped,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_child(path: Path, oversize: str = "truncate") -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), oversize], capture_output=True, text=True,
                         timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _good_members(tar: tarfile.TarFile) -> None:
    for k in range(GOOD):
        _add(tar, f"g{k}.json", json.dumps({"conversations": CONV}).encode())
        _add(tar, f"g{k}.png", png(40 + k))


def gnu_sparse_header(name: str, claimed: int, stored: int) -> bytes:
    """An old-GNU sparse member header ('S') whose real size is ``claimed`` with ``stored`` bytes of data."""
    h = bytearray(512)
    h[0:len(name)] = name.encode()
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = f"{stored:011o}\0".encode()
    h[136:148] = b"00000000000\0"
    h[156:157] = b"S"
    h[257:265] = b"ustar  \0"
    h[386:398] = f"{claimed - stored:011o}\0".encode()  # one data chunk at the end of the claimed size
    h[398:410] = f"{stored:011o}\0".encode()
    h[483:495] = f"{claimed:011o}\0".encode()  # realsize
    h[148:156] = b"        "
    h[148:156] = f"{sum(h):06o}\0 ".encode()
    return bytes(h)


def case_sparse_tar(root: Path, hostile: bool) -> None:
    with open(root / "shard.tar", "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
            _good_members(tar)
            if hostile:
                _add(tar, "bomb.json", json.dumps({"conversations": CONV}).encode())
                tar.fileobj.write(gnu_sparse_header("bomb.png", 8 * 2**30, 512) + b"\x89PNG" + bytes(508))
                tar.offset += 1024


def case_targz_bomb(root: Path, hostile: bool) -> None:
    with tarfile.open(root / "shard.tar.gz", "w:gz", compresslevel=1) as tar:
        _good_members(tar)
        if hostile:
            _add(tar, "bomb.json", json.dumps({"conversations": CONV}).encode())
            info = tarfile.TarInfo("bomb.png")
            info.size = 2**30

            class Zeros(io.RawIOBase):
                def readable(self):
                    return True

                def readinto(self, b):
                    b[:] = bytes(len(b))
                    return len(b)
            tar.addfile(info, io.BufferedReader(Zeros(), 1 << 20))


def case_text_cell(root: Path, hostile: bool) -> None:
    convs = [CONV] * GOOD
    images = [[{"bytes": png(40 + k), "path": f"{k}.png"}] for k in range(GOOD)]
    if hostile:
        convs = convs + [[{"from": "human", "value": "Summarize."}, {"from": "gpt", "value": "word " * 10_000_000}]]
        images = images + [[]]
    pq.write_table(pa.table({"images": pa.array(images, pa.list_(pa.struct([("bytes", pa.binary()),
                                                                             ("path", pa.string())]))),
                             "conversations": pa.array(convs)}), root / "train.parquet")


def _llava(root: Path, extra: list[dict]) -> None:
    (root / "img").mkdir()
    records = []
    for k in range(GOOD):
        (root / "img" / f"{k}.png").write_bytes(png(40 + k))
        records.append({"id": f"g{k}", "image": f"img/{k}.png", "conversations": CONV})
    (root / "data.json").write_text(json.dumps(records + extra))


def case_sparse_image_file(root: Path, hostile: bool) -> None:
    _llava(root, [{"id": "huge", "image": "img/huge.png", "conversations": CONV}] if hostile else [])
    if hostile:
        with open(root / "img" / "huge.png", "wb") as f:
            f.write(png())
            f.truncate(2**30)  # 1 GiB, sparse on disk


def case_png16(root: Path, hostile: bool) -> None:
    _llava(root, [{"id": "deep", "image": "img/deep.png", "conversations": CONV}] if hostile else [])
    if hostile:
        Image.fromarray(np.zeros((9000, 9000), np.uint16)).save(root / "img" / "deep.png")


CASES = {"gnu_sparse_member_8GiB": (case_sparse_tar, S.SKIP_FILE_TOO_LARGE, "data.max_file_bytes"),
         "tar_gz_bomb_1GiB": (case_targz_bomb, S.SKIP_FILE_TOO_LARGE, "data.max_file_bytes"),
         "text_cell_50MB": (case_text_cell, S.SKIP_OVERSIZE, "max_tokens"),  # with --oversize skip
         "sparse_image_file_1GiB": (case_sparse_image_file, S.SKIP_FILE_TOO_LARGE, "data.max_file_bytes"),
         "png_16bit_9000x9000": (case_png16, S.SKIP_DECOMPRESSION_BOMB, "image.max_decoded_bytes")}


@pytest.mark.parametrize("case", list(CASES))
def test_limit_skips_before_reading_and_memory_stays_flat(tmp_path, case):
    build, reason, setting = CASES[case]
    clean, hostile = tmp_path / "clean", tmp_path / "hostile"
    clean.mkdir()
    hostile.mkdir()
    build(clean, False)
    build(hostile, True)
    oversize = "skip" if reason == S.SKIP_OVERSIZE else "truncate"
    base, got = run_child(clean, oversize), run_child(hostile, oversize)
    assert len(base["trained"]) == GOOD and not base["skipped"]
    assert len(got["trained"]) == GOOD, got["skipped"]
    [(sid, why)] = got["skipped"].items()
    assert why.startswith(reason) and setting in why, why
    print(f"{case}: peak {got['peak_mb']:.0f} MB vs clean {base['peak_mb']:.0f} MB")
    assert got["peak_mb"] < base["peak_mb"] + SLACK_MB, (got["peak_mb"], base["peak_mb"])


def test_text_cell_cut_before_tokenizing_then_truncated(tmp_path):
    """--oversize truncate (the default): the 50 MB answer is cut to data.max_text_chars before the
    tokenizer sees it, then truncated to the budget and trained; memory stays flat."""
    case_text_cell(tmp_path, True)
    got = run_child(tmp_path, "truncate")
    assert len(got["trained"]) == GOOD + 1 and not got["skipped"]
    clean = tmp_path / "clean"
    clean.mkdir()
    case_text_cell(clean, False)
    base = run_child(clean, "truncate")
    print(f"text cell, truncate: peak {got['peak_mb']:.0f} MB vs clean {base['peak_mb']:.0f} MB")
    assert got["peak_mb"] < base["peak_mb"] + SLACK_MB

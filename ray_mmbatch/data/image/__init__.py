"""Images: header probe, resize as the checkpoint's HF processor does, decode to RGB, patchify.

Modules, each importing only those listed before it:

* ``core``: probe_image (header only), decoding (``_load``: Pillow, EXIF orientation, HF
  ``convert_to_rgb``), patchify / unpatchify, ImageSkip, the Resizer shape
* one module a resize family (``ImageConfig.resize``), each reproducing one HF image processor:
  ``smart`` ('smart': Qwen2-VL / Qwen2.5-VL / Qwen3-VL ``smart_resize``; 'smart_glm': GLM-4.1V's),
  ``tiles`` ('tiles': InternVL, GotOcr2 ``crop_to_patches``), ``anyres`` ('anyres': LLaVA-OneVision),
  ``split`` ('split': Idefics3 / SmolVLM with image splitting),
  ``budget`` ('budget': Gemma 4, the aspect kept within a patch budget),
  ``pixtral`` ('pixtral': Mistral 3, the longest edge bounded, sides rounded up to merged patches),
  ``square`` (one image_size view: 'fixed' CLIP / LLaVA-1.5, 'fixed_pad'
  LLaVA ``do_pad``, 'squash' Gemma 3, 'global' Idefics3 / SmolVLM without splitting)
* ``registry``: RESIZERS (mode -> Resizer), RESIZE_MODES, and image_grid / image_tokens / decode_image,
  which dispatch on the mode

Exactness: with the default ``fast_decode=False`` the uint8 pixels equal what the HF image
processor (PIL backend) sees after its own resize / crop, so ``models.hf_common.normalize_patches``
gives HF's ``pixel_values`` (tests/test_image_hf.py, atol 1e-5) in every mode; the stacked modes
('tiles', 'split', 'anyres') stack their tiles / views top to bottom, a grid of (1, n * S/ps, S/ps).
Decoding is Pillow's, EXIF orientation applied (as HF's ``load_image`` does), then HF's
``convert_to_rgb`` (alpha and transparency keys composited on white; 16-bit / float greys clipped
at 255 by Pillow, as in HF), then the family's PIL resize (bicubic; bilinear for 'squash', Lanczos
for 'split' / 'global') on uint8 with no ``reducing_gap``. Where we differ, deliberately:
aspect ratios above ``max_aspect`` (HF Qwen-VL: 200) are skipped (extreme_aspect) in every
mode, also 'fixed' where HF would crop the middle; an unreadable EXIF block counts as upright.
HF itself is not one thing here: its processors given an already-opened PIL image apply no
EXIF orientation (we do, as its loader does), and its ``load_image`` drops alpha without
compositing (we composite on white, as its processors do).

Cost model: ``probe_image`` parses the header only (no pixel decoding, ~10-50 us; for
PNG the EXIF orientation is read without Pillow's full decode unless a metadata chunk
follows the pixel data), so measuring a sample's image tokens is cheap and exact before
any pixel is touched (2,164 generated images: 0.83 s -> 0.08 s once PNGs stopped decoding).
``decode_image`` is the expensive step (once per trained sample): exact decode reads every
JPEG at full scale, so its cost grows with the file's pixels, not the grid: 2-6x the
``fast_decode`` cost for JPEGs at least twice the target's sides, the same for PNG and for
JPEGs near the target (benchmarks/bench_decode.py; figures in benchmarks/RESULTS.md).
``fast_decode`` decodes big JPEGs at a reduced DCT scale (``draft``) and resizes with
``reducing_gap``: cheaper, pixels no longer HF's. Grey images (documents, the largest here)
are resized as one band before becoming RGB (same bytes as HF, ~1/3 the resize work).

Patch order (what the model relies on), for a grid of gh x gw patches, merge m::

    merge block (0,0)        merge block (0,1)   ...   row-major over (gh/m, gw/m)
    p(0,0) p(0,1)            p(0,2) p(0,3)
    p(1,0) p(1,1)            p(1,2) p(1,3)
    -> patches 0..3          -> patches 4..7

so ``patches.reshape(-1, m*m*D)`` is one row per LM image token (Qwen2-VL's order).
Each patch vector is channel-major ``[3, ps, ps]`` flattened (D = 3*ps*ps).
The names below are the package's public API. Pure package: PIL + numpy, no ray, no torch.
"""
from __future__ import annotations

from ray_mmbatch.data.image.anyres import anyres_tiles, anyres_tokens, select_best_resolution
from ray_mmbatch.data.image.budget import budget_resize
from ray_mmbatch.data.image.core import ImageSkip, Resizer, decoded_bytes_per_pixel, patchify, probe_image, unpatchify
from ray_mmbatch.data.image.pixtral import pixtral_resize
from ray_mmbatch.data.image.registry import RESIZE_MODES, RESIZERS, decode_image, image_grid, image_runs, image_tokens
from ray_mmbatch.data.image.smart import glm_smart_resize, smart_resize
from ray_mmbatch.data.image.split import longest_edge_size, split_grid
from ray_mmbatch.data.image.square import shortest_edge_resize
from ray_mmbatch.data.image.tiles import n_tiles, tile_canvas

__all__ = [
    "RESIZERS", "RESIZE_MODES", "ImageSkip", "Resizer", "anyres_tiles", "anyres_tokens", "budget_resize",
    "decode_image", "glm_smart_resize",
    "decoded_bytes_per_pixel", "image_grid", "image_runs", "image_tokens", "longest_edge_size", "n_tiles", "patchify",
    "pixtral_resize", "probe_image", "select_best_resolution", "shortest_edge_resize", "smart_resize", "split_grid",
    "tile_canvas", "unpatchify",
]

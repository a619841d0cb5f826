"""Column names, special tokens and the row / batch layouts, in one place.

Every stage of the data path speaks these names::

    read        -> RAW row        (bytes only, nothing decoded)
    measure     -> MEASURED row   (RAW + token ids + costs + skip_reason)
    plan        -> PLAN row       (one row per batch: the measured rows of that batch)
    materialize -> BATCH row      (one row per batch: ready arrays, see batching/collate.py)

Pure module: no ray, no torch.
"""
from __future__ import annotations

# ---------------------------------------------------------------- RAW row
# One row per sample, as produced by every reader (data/sources.py).
SAMPLE_ID = "sample_id"          # str, unique within a dataset
CONVERSATIONS = "conversations"  # str: JSON list of {"from": "system"|"human"|"gpt", "value": str}
IMAGES = "images"                # list<binary>: encoded media files (images, and video containers: mp4 /
                                 # webm / mkv ... told apart by their bytes, data/video.is_video), in the order
                                 # of their placeholders in the text; never decoded at read time
IMAGE_REFS = "image_refs"        # list<str>: where each image came from (path / tar member), for reports
READ_ERROR = "read_error"        # str: "" when the record was read fine, else a skip reason (see SKIP_*)

RAW_COLUMNS = (SAMPLE_ID, CONVERSATIONS, IMAGES, IMAGE_REFS, READ_ERROR)

# Where a RAW row was read (appended by readers.read_with_position; data/position.py):
# the resume state is kept per read unit, never per sample.
UNIT = "unit"                    # int64: the read unit's index in the sorted unit list (-1: end-of-stream row)
UNIT_ROW = "unit_row"            # int64: the row's index within its read unit
UNIT_ROWS = "unit_rows"          # int64: rows the read unit holds
READ_POSITION_COLUMNS = (UNIT, UNIT_ROW, UNIT_ROWS)

# ----------------------------------------------------------- MEASURED row
# RAW columns plus (data/measure.py):
TEXT_IDS = "text_ids"            # list<int32>: token ids, ONE IMAGE_PAD token per image (not yet expanded)
TEXT_TARGET = "text_target"      # list<uint8>: 1 where that token is a training target (answer tokens)
GRIDS = "grids"                  # list<list<int32>>: per image (t, h, w) in patches, t == 1
TEXT_TOKENS = "text_tokens"      # int: len(text_ids) - n_images
IMAGE_TOKENS = "image_tokens"    # int: sum over images of h * w / merge**2
PATCHES = "patches"              # int: sum over images of t * h * w (vision-encoder sequence length)
N_IMAGES = "n_images"            # int
TOKENS = "tokens"                # int: full LM sequence length = text_tokens + image_tokens
SKIP_REASON = "skip_reason"      # str: "" if usable, else one of SKIP_* (skip_text: "reason: detail")
# The id of the tokenizer's IMAGE_PAD token, carried on every measured row so that
# stages holding no tokenizer (oversize policy, materialize) can find the image slots
# in TEXT_IDS; a different tokenizer gives a different id, so it cannot be a constant.
IMAGE_TOKEN_ID = "image_token_id"  # int
# Video (data/video.py): a video is one media item of IMAGES; its GRIDS row is (t, h, w) with t the
# temporal patches (sampled frames / temporal_patch_size); IMAGE_TOKENS and PATCHES include its tokens
# and patches; N_IMAGES counts images only.
N_FRAMES = "n_frames"            # int: frames sampled from the sample's videos (the max_frames budget)
N_VIDEOS = "n_videos"            # int
VIDEO_TOKENS = "video_tokens"    # int: the part of IMAGE_TOKENS that is video
VIDEO_TOKEN_ID = "video_token_id"  # int: id of the video pad token (-1: the family takes no video)
VIDEO_PLANS = "video_plans"      # list<str>: per video, in media order, its plan (data/video VideoPlan.to_json:
                                 # indices, grid, where each sampled frame sits): materialize decodes by it,
                                 # the clip is probed once per sample

MEASURED_COLUMNS = RAW_COLUMNS + (
    TEXT_IDS, TEXT_TARGET, GRIDS, TEXT_TOKENS, IMAGE_TOKENS, PATCHES, N_IMAGES, TOKENS, SKIP_REASON, IMAGE_TOKEN_ID,
    N_FRAMES, N_VIDEOS, VIDEO_TOKENS, VIDEO_TOKEN_ID, VIDEO_PLANS,
)

# --------------------------------------------------------------- skip reasons
# A sample that cannot be used is never dropped silently: it carries one of these
# reasons (optionally "reason: detail") and is counted and reported by id.
SKIP_MALFORMED_RECORD = "malformed_record"        # JSON / schema of the record is wrong
SKIP_MISSING_FILE = "missing_file"                # image path does not exist
SKIP_PATH_OUTSIDE_ROOT = "path_outside_root"      # image path escapes the image folder (never read)
SKIP_EMPTY_FILE = "empty_file"                    # zero bytes
SKIP_NOT_AN_IMAGE = "not_an_image"                # Pillow cannot identify it
SKIP_UNSUPPORTED_FORMAT = "unsupported_format"    # identified, but not an allowed format
SKIP_DECOMPRESSION_BOMB = "decompression_bomb"    # header pixel count over the limit
SKIP_CORRUPT_IMAGE = "corrupt_image"              # header fine, pixel data broken / truncated
SKIP_EXTREME_ASPECT = "extreme_aspect"            # long side / short side > ImageConfig.max_aspect (HF Qwen-VL: 200)
SKIP_PLACEHOLDER_MISMATCH = "placeholder_mismatch"  # <image> placeholders != number of images
SKIP_UNSUPPORTED_MODALITY = "unsupported_modality"  # a modality the data path does not train (audio)
SKIP_TEXT_ENCODING = "text_encoding"              # text cannot be encoded (e.g. lone surrogates)
SKIP_EMPTY_TEXT = "empty_text"                    # nothing to train on (no target tokens)
SKIP_OVERSIZE = "oversize"                        # cannot fit any batch and policy is "skip"
SKIP_TOO_MANY_IMAGES = "too_many_images"          # more images than max_images allows
SKIP_FILE_TOO_LARGE = "file_too_large"            # an image file / tar member over data.max_file_bytes (never read)
SKIP_UNREADABLE_VIDEO = "unreadable_video"        # a video container whose header PyAV cannot read (never decoded)
SKIP_EMPTY_VIDEO = "empty_video"                  # a video stream with zero frames (or no video stream)
SKIP_CORRUPT_VIDEO = "corrupt_video"              # header fine, a sampled frame cannot be decoded
# A read unit that cannot be read at all (corrupt / not Parquet, unreadable or dangling shard, FIFO,
# a file without the text column): ONE row whose sample id is the file's path; counted as a skipped
# FILE (skipped_files), not as a sample; the run goes on with the other files.
SKIP_UNREADABLE_FILE = "unreadable_file"

# End-of-stream marker: one RAW row the readers append after the last sample when
# the plan stage carries batches across windows (batching/carry.py). It is not a
# sample: it rides through measure as a read error and the plan stage removes it.
END_OF_STREAM = "end_of_stream"                  # its READ_ERROR / SKIP_REASON value
END_OF_STREAM_ID = "<|end_of_stream|>"           # its SAMPLE_ID

# ---------------------------------------------------------------- PLAN row
BATCH_ID = "batch_id"            # str: "<window key>/<index in window>", stable across runs in deterministic mode
BATCH_SAMPLE_IDS = "sample_ids"  # list<str>

# ---------------------------------------------------------------- BATCH row
# One row per planned batch after materialize. The arrays travel as one binary
# column (collate.encode_batch / decode_batch) so variable shapes cross Ray Data
# untouched; the scalar columns are there for stats without decoding.
BATCH_PAYLOAD = "payload"        # binary: encoded dict of numpy arrays (collate.encode_batch)
BATCH_REAL_TOKENS = "real_tokens"      # int: non-padding tokens in the batch
BATCH_PADDED_TOKENS = "padded_tokens"  # int: tokens of compute the batch occupies
                                       # (budget for pack, rows*longest for pad)
BATCH_TARGET_TOKENS = "target_tokens"  # int: tokens with a label (loss normalizer)
BATCH_N_SAMPLES = "n_samples"          # int
BATCH_SKIPPED = "skipped"              # str: the batch's skip records (data/errors.encode_skips)
BATCH_POSITIONS = "positions"          # list<int64>: read position (data/position.py) of each sample id (-1: none)
BATCH_POSITION_UNIT_ROWS = "position_unit_rows"  # list<int64>: row count of each position's read unit
# Where the data time went (dataflow/timing.py): the stages' wall seconds travel with the data.
# On a PLAN row [read_s, measure_s, plan_s]; on a BATCH row + [materialize_s, produced_at (unix s)].
BATCH_DATA_TIME = "data_time"          # list<float64>: seconds of the batch's samples (skipped ones too)

# ------------------------------------------------------------ stage seconds
# Per sample, on RAW rows (read_raw(timed=True)) and LIGHT rows (MeasureStage): its share of the
# wall seconds of the call that read / measured it (the call's time over its rows).
READ_S = "read_s"                # float64
MEASURE_S = "measure_s"          # float64

# ---------------------------------------------------------- special tokens
# The shipped tokenizer (assets/tokenizer) has these; any other HF tokenizer gets
# the missing ones added (data/text/tokenizer.py).
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD)

# The placeholder users write in their data (LLaVA convention). It is a data
# convention, not a token: only in human turns of samples that have images does
# it mark an image slot; everywhere else it is plain text.
IMAGE_PLACEHOLDER = "<image>"
# A video's placeholder (LLaVA-Video-178K); the media item it marks must be a video. Some LLaVA-NeXT
# exports write <image> for a video too: an <image> placeholder takes whatever media item is next.
VIDEO_PLACEHOLDER = "<video>"
# An audio clip's slot (an HF messages audio part becomes one): no family trains audio here, so a user turn holding
# one is skipped (unsupported_modality), naming the checkpoint's family (TextConfig.family), never trained as text.
AUDIO_PLACEHOLDER = "<audio>"

IGNORE_INDEX = -100

# Conversation roles as data writes them (any case) -> the RAW row's role. The one table;
# data/text/conversations.py maps RAW roles on to the chat template's system / user / assistant.
ROLE_NAMES = {"system": "system", "human": "human", "user": "human", "gpt": "gpt", "assistant": "gpt"}


def canonical_role(role) -> str | None:
    """'Human', 'USER', 'gpt', 'Assistant' ... -> system | human | gpt; None for anything else."""
    return ROLE_NAMES.get(role.strip().lower()) if isinstance(role, str) else None

# The files of a run folder: run/rundir.py (RunDir).


# ---------------------------------------------------------------- epochs and resume
def epoch_dataset_name(epoch: int) -> str:
    """The Ray Train dataset name of one epoch's stream (one dataset per epoch, train/trainer.py)."""
    return f"train_e{epoch}"



# ---------------------------------------------------------------- skip text
# A skip travels as text in the RAW / MEASURED columns (READ_ERROR, SKIP_REASON: "reason" or
# "reason: detail", built by skip_text and split by parse_skip, nowhere else); from the plan
# stage on it is a data/errors.SkipRecord.
def skip_text(reason: str, detail: str = "") -> str:
    """The column text of a skip: ``"reason"`` or ``"reason: detail"``."""
    return f"{reason}: {detail}" if detail and detail != reason else reason


def parse_skip(text: str) -> tuple[str, str]:
    """``"reason: detail"`` -> (reason, detail); the inverse of skip_text."""
    reason, _, detail = str(text).partition(":")
    return reason.strip(), detail.strip()

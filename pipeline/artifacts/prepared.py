"""data/prepared/: the prepare stage's output, read by train, evaluate, optimize, benchmark, deploy and monitor.

    data/prepared/{train,val,test}/images-NNNNN.npy  image shards: uint8 [n, S, S, 3] RGB, at most data.shard_mb each
    data/prepared/{train,val,test}/labels.npy        uint8 [N]; tracks.npy: int32 [N] (class * 100_000 + group, -1)
    data/prepared/manifest.json          PreparedManifest: image size, classes, mean/std, each split's shards with
                                         their counts and SHA-256, the content hash
    data/prepared/test_files/            the test split's original image files, byte for byte, in the arrays'
                                         order: what a user sends the server (whole images, no box)

Why `.npy` shards read by offset (and not WebDataset, LitData or MDS): the training loader's guarantees (one
global permutation per epoch, resume at the same sample with another process count) need any sample by its
index; a row of a shard is at a fixed offset, so a batch is one `pread` per image, straight into the batch
buffer. Nothing is memory-mapped, so a process holds only its batches, whatever the data's size (a mapped file
counts in RSS as it is touched). WebDataset's tar streams are sequential (a shuffle buffer, no global order);
LitData and MDS index samples too, but add their own chunk format, cache and workers to what numpy reads.

The writer streams: shards are written as they are filled, the content hash and per-channel sums are updated as
they go, the folder is staged and swapped in whole, so readers never see half of it. numpy and pydantic only:
the server image and `pipeline monitor` read it without torch.

Its parts live in pipeline/artifacts/_prepared/: schema.py (paths, the manifest, the in-memory arrays), writer.py,
storage.py (LocalFiles, DvcRemoteFiles: the `Files` protocol) and reader.py; every name is importable from here.
"""

from __future__ import annotations

from pipeline.artifacts._prepared.reader import (
    ModelInput,
    OriginalFile,
    SplitReader,
    read_manifest,
    read_split,
    read_test_files,
)
from pipeline.artifacts._prepared.schema import (
    LABELS_FILE,
    MANIFEST_FILE,
    PREPARED_DIR,
    RERUN,
    SHARD_MB,
    SPLITS,
    TEST_FILES,
    TRACKS_FILE,
    BadImages,
    DataSubject,
    PreparedManifest,
    ShardInfo,
    SplitArrays,
    SplitInfo,
    content_sha256,
    to_model_input,
)
from pipeline.artifacts._prepared.storage import (
    DvcRemoteFiles,
    Files,
    LocalFiles,
    files_of,
)
from pipeline.artifacts._prepared.writer import (
    SplitStats,
    Writer,
    write,
)

# Every name, in the order the API page (docs/api/artifacts.md) shows them.
__all__ = [  # noqa: RUF022
    "PREPARED_DIR",
    "MANIFEST_FILE",
    "TEST_FILES",
    "SPLITS",
    "LABELS_FILE",
    "TRACKS_FILE",
    "RERUN",
    "SHARD_MB",
    "SplitArrays",
    "to_model_input",
    "ModelInput",
    "ShardInfo",
    "DataSubject",
    "SplitInfo",
    "BadImages",
    "PreparedManifest",
    "content_sha256",
    "SplitStats",
    "Writer",
    "write",
    "LocalFiles",
    "DvcRemoteFiles",
    "Files",
    "files_of",
    "read_manifest",
    "SplitReader",
    "read_split",
    "OriginalFile",
    "read_test_files",
]

"""Regenerate predict_v2_pb2.py and .pyi from predict_v2.proto with grpcio-tools' bundled protoc (a dev
dependency; the server needs only protobuf's runtime). tests/serve/test_grpc.py checks they are up to date."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the repository: the generated module imports as pipeline.serve.oip.predict_v2_pb2


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", str(HERE / "predict_v2.proto")]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(ROOT if len(sys.argv) < 2 else Path(sys.argv[1]))

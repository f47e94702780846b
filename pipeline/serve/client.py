"""The HTTP client of the inference server, shared by deploy's smoke test and `pipeline monitor`.

Smoke test of a running server through its HTTP API, on the prepared test images.

The prepared test arrays are already cropped and resized (uint8 [N,S,S,3]): sent as FP32 [N,3,S,S]/255
through the Open Inference Protocol (binary tensor extension), or as PNG files through /v1/predict, they
reach the model exactly as the evaluate stage fed them. So the accuracy through the API must equal the
evaluate stage's (for the fp32 variant), image for image.
"""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import StageError


@dataclass
class SmokeResult:
    images: int
    correct: int
    predictions: list[int]
    png_checked: int = 0
    png_agree: int = 0
    seconds: float = 0.0
    model: dict[str, Any] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return self.correct / self.images if self.images else 0.0


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout_s: float = 30.0
) -> tuple[int, dict[str, str], bytes]:
    """One request; returns (status, headers, body) for every HTTP status, raises StageError when unreachable."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
    except (OSError, ValueError) as exc:
        raise StageError(f"{method} {url}: {exc}") from None


def _infer_binary(
    base_url: str, model_name: str, shape: list[int], datatype: str, raw: bytes, output: str
) -> dict[str, Any]:
    """One OIP v2 request whose single input travels as binary data (Triton's binary tensor extension);
    returns the requested output tensor (JSON)."""
    header = json.dumps(
        {
            "inputs": [
                {"name": "images", "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": len(raw)}}
            ],
            "outputs": [{"name": output, "parameters": {"binary_data": False}}],
        }
    ).encode()
    status, _, body = http(
        "POST",
        f"{base_url}/v2/models/{model_name}/infer",
        header + raw,
        {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))},
    )
    if status != 200:
        raise StageError(f"OIP v2 {datatype} inference failed: HTTP {status}: {body[:300]!r}")
    (tensor,) = json.loads(body)["outputs"]
    return dict(tensor)


def fp32_tensor(images: np.ndarray) -> np.ndarray:
    """uint8 [N,S,S,3] images as the FP32 [N,3,S,S] tensor in [0, 1] that this client sends (and evaluate feeds the
    shipped model, so that both compute on the same numbers)."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype="<f4") / np.float32(255.0)


def infer_fp32(base_url: str, model_name: str, images: np.ndarray, output: str = "class_id") -> np.ndarray:
    """Class ids (or `probabilities`) for uint8 [N,S,S,3] images, sent as FP32 [N,3,S,S]/255 with the binary
    tensor extension."""
    batch = fp32_tensor(images)
    raw = np.ascontiguousarray(batch, dtype="<f4").tobytes()
    tensor = _infer_binary(base_url, model_name, list(batch.shape), "FP32", raw, output)
    values = np.asarray(tensor["data"], dtype=np.int64 if output == "class_id" else np.float32)
    return values.reshape(tensor["shape"])


def infer_files(base_url: str, model_name: str, files: list[bytes], batch_size: int = 32) -> list[int]:
    """Top-1 class ids for encoded image files sent byte for byte as an OIP v2 BYTES tensor [N] with the binary
    data extension (each element a 4-byte little-endian length, then the bytes), as tritonclient sends them."""
    predicted: list[int] = []
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        raw = b"".join(len(data).to_bytes(4, "little") + data for data in chunk)
        tensor = _infer_binary(base_url, model_name, [len(chunk)], "BYTES", raw, "class_id")
        predicted.extend(int(v) for v in tensor["data"])
    return predicted


def multipart(
    files: list[bytes], kind: str = "png", boundary: str = "----pipeline-smoke-boundary"
) -> tuple[bytes, str]:
    """A multipart body with each encoded image as a file (field `files`, image/`kind`), and its Content-Type."""
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{i}.{kind}"\r\n'
        f"Content-Type: image/{kind}\r\n\r\n".encode()
        + data
        + b"\r\n"
        for i, data in enumerate(files)
    ]
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def encode(image: Any, kind: str = "png") -> bytes:
    """A PIL image or uint8 HWC array as PNG (lossless) or JPEG (quality 95, what cameras and phones send)."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG" if kind == "png" else "JPEG", quality=95)
    return buffer.getvalue()


def predict_files(base_url: str, files: list[bytes], kind: str = "png", batch_size: int = 32) -> list[int]:
    """Top-1 class ids for encoded image files sent whole (no box) through /v1/predict, `batch_size` a request."""
    predicted: list[int] = []
    for start in range(0, len(files), batch_size):
        body, content_type = multipart(files[start : start + batch_size], kind)
        status, _, answer = http("POST", f"{base_url}/v1/predict", body, {"Content-Type": content_type})
        if status != 200:
            raise StageError(f"/v1/predict ({kind} files) failed: HTTP {status}: {answer[:300]!r}")
        predicted.extend(top1(answer))
    return predicted


def top1(answer: bytes) -> list[int]:
    """Top-1 class ids from a /v1/predict answer."""
    return [int(p["top_k"][0]["class_id"]) for p in json.loads(answer)["predictions"]]


def predict_png(base_url: str, images: np.ndarray) -> list[int]:
    """Top-1 class ids for uint8 model-size images (prepared crops) sent as PNG files through /v1/predict, each
    with its whole extent as the sign's box: the server then decodes exactly these pixels (a box + margin clipped
    to the image, resized to the size it already has), where a file without a box would be framed again (the
    served crop cuts its borders) and differ from the tensor path's input."""
    import base64

    items = [
        {"data": base64.b64encode(encode(image)).decode(), "box": [0, 0, image.shape[1] - 1, image.shape[0] - 1]}
        for image in images
    ]
    body = json.dumps({"images": items}).encode()
    status, _, answer = http("POST", f"{base_url}/v1/predict", body, {"Content-Type": "application/json"})
    if status != 200:
        raise StageError(f"/v1/predict failed: HTTP {status}: {answer[:300]!r}")
    return top1(answer)


def smoke_test(
    base_url: str,
    model_name: str,
    images: np.ndarray,
    labels: np.ndarray,
    batch_size: int = 64,
    png_images: int = 32,
) -> SmokeResult:
    """Every image through OIP (FP32), the first `png_images` also as PNG through /v1/predict."""
    started = time.perf_counter()
    status, _, body = http("GET", f"{base_url}/v2/models/{model_name}")
    if status != 200:
        raise StageError(f"model metadata: HTTP {status}: {body[:200]!r}")
    metadata = json.loads(body)
    predictions: list[int] = []
    for start in range(0, len(images), batch_size):
        predictions.extend(infer_fp32(base_url, model_name, images[start : start + batch_size]).tolist())
    result = SmokeResult(
        images=len(images),
        correct=int((np.asarray(predictions) == labels).sum()),
        predictions=predictions,
        model={
            "version": (metadata.get("versions") or ["?"])[0],
            "variant": metadata.get("parameters", {}).get("variant"),
        },
    )
    if png_images:
        # The PNG's top-1 must be a top-1 of the tensor path: an int8 model's quantized logits can tie exactly,
        # and then which of the tied classes comes first is the API's choice, not a difference in the input.
        subset = images[:png_images]
        png = predict_png(base_url, subset)
        probabilities = infer_fp32(base_url, model_name, subset, "probabilities")
        result.png_checked = len(png)
        result.png_agree = sum(int(row[c] == row.max()) for row, c in zip(probabilities, png, strict=True))
    result.seconds = time.perf_counter() - started
    return result

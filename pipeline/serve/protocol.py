"""Request parsing for both APIs: Open Inference Protocol v2 tensors (JSON or Triton's binary tensor
extension) and image uploads. Everything a client can get wrong raises BadRequest with a message."""

from __future__ import annotations

import base64
import binascii
import math
import struct
from typing import Any

import numpy as np
import orjson
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from python_multipart.multipart import parse_options_header

from pipeline.images.preprocess import BadImage, Box, Framing, UnsupportedFormat, peek_image

BINARY_HEADER = "inference-header-content-length"
MAX_DIMENSION = 1 << 20  # any one tensor dimension; the real limits (batch, image side) are checked after


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    parameters: dict[str, Any] | None = None


class TensorInput(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferRequest(BaseModel):
    """POST /v2/models/{name}/infer (KServe / Triton / MLServer's REST protocol)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[TensorInput] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None


class ImageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str = Field(description="base64-encoded image file (PNG, JPEG, PPM, ...)")
    box: tuple[int, int, int, int] | None = Field(
        None, description="optional object region x1, y1, x2, y2 (inclusive corners, in the file's pixels)"
    )


class PredictRequest(BaseModel):
    """POST /v1/predict as JSON: images as base64 strings or {data, box} objects."""

    model_config = ConfigDict(extra="forbid")
    images: list[str | ImageItem] = Field(min_length=1)
    top_k: int | None = Field(None, ge=1, le=256)


def parse_infer_body(body: bytes, header_length: str | None) -> tuple[InferRequest, bytes]:
    """Split the JSON header from trailing binary tensor data (binary extension) and validate it."""
    binary = b""
    if header_length is not None:
        try:
            size = int(header_length)
        except ValueError:
            raise BadRequest("Inference-Header-Content-Length must be an integer") from None
        if not 0 < size <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {size} does not fit a body of {len(body)} bytes")
        body, binary = body[:size], body[size:]
    try:
        return InferRequest.model_validate_json(body), binary
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadRequest(f"invalid inference request: {where}: {first['msg']}") from None


def _binary_slice(tensor: TensorInput, binary: bytes, offset: int) -> tuple[bytes | None, int]:
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is None:
        return None, offset
    if not isinstance(size, int) or size < 0 or offset + size > len(binary):
        raise BadRequest(f"input {tensor.name!r}: binary_data_size {size} exceeds the binary data sent")
    return binary[offset : offset + size], offset + size


def _split_bytes_elements(raw: bytes, count: int, name: str) -> list[bytes]:
    """BYTES tensors in the binary extension: each element is a 4-byte little-endian length + data."""
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise BadRequest(f"input {name!r}: truncated BYTES element header")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise BadRequest(f"input {name!r}: BYTES element longer than the data sent")
        items.append(raw[offset : offset + length])
        offset += length
    if len(items) != count:
        raise BadRequest(f"input {name!r}: shape says {count} elements, data holds {len(items)}")
    return items


def _b64(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise BadRequest(f"{where}: expected a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: not valid base64") from None


PIXEL_TYPES = {"FP32": ("<f4", 4), "UINT8": ("u1", 1)}


def tensor_images(
    request: InferRequest, binary: bytes, image_size: int, max_images: int
) -> list[np.ndarray] | list[bytes]:
    """The single input as a float32 batch [N,3,S,S] in [0, 1] (from FP32, or UINT8 pixels) or a list of encoded
    images (BYTES)."""
    if len(request.inputs) != 1:
        raise BadRequest(f"expected exactly one input tensor, got {len(request.inputs)}")
    tensor = request.inputs[0]
    shape = tensor.shape
    # Checked before any arithmetic on it: a product of huge dimensions is big-integer work that would stall
    # the event loop (and numpy's product silently overflows).
    if len(shape) > 4 or any(not isinstance(d, int) or not 0 <= d <= MAX_DIMENSION for d in shape):
        raise BadRequest(
            f"input {tensor.name!r}: shape must be at most 4 integers in 0..{MAX_DIMENSION}, got {shape[:8]}"
        )
    raw, _ = _binary_slice(tensor, binary, 0)
    if tensor.datatype in PIXEL_TYPES:
        return [_pixel_batch(tensor, raw, image_size, max_images)]
    if tensor.datatype == "BYTES":
        return _encoded_images(tensor, raw, max_images)
    raise BadRequest(f"input {tensor.name!r}: datatype must be FP32, UINT8 or BYTES, got {tensor.datatype!r}")


def _pixel_batch(tensor: TensorInput, raw: bytes | None, image_size: int, max_images: int) -> np.ndarray:
    """FP32: pixels / 255, as the model takes them; UINT8: the pixels themselves (a quarter of the bytes)."""
    kind, shape = tensor.datatype, tensor.shape
    if len(shape) != 4 or shape[1:] != [3, image_size, image_size]:
        raise BadRequest(f"input {tensor.name!r}: {kind} shape must be [N, 3, {image_size}, {image_size}], got {shape}")
    if not 1 <= shape[0] <= max_images:
        raise BadRequest(f"input {tensor.name!r}: batch must be 1..{max_images}, got {shape[0]}")
    count = math.prod(shape)
    dtype, width = PIXEL_TYPES[kind]
    if raw is not None:
        if len(raw) != count * width:
            raise BadRequest(f"input {tensor.name!r}: {len(raw)} bytes for {count} {kind} values")
        array = np.frombuffer(raw, dtype=dtype)
    else:
        array = _json_pixels(tensor, count)
    if kind == "UINT8":
        return (array.astype(np.float32) * np.float32(1 / 255)).reshape(shape)
    if raw is not None:
        array = array.astype(np.float32)  # frombuffer's view is read-only: a writable copy, as before
    if not np.isfinite(array).all():
        raise BadRequest(f"input {tensor.name!r}: values must be finite")
    return array.reshape(shape)


def _json_pixels(tensor: TensorInput, count: int) -> np.ndarray:
    """An FP32 or UINT8 tensor's JSON `data`, checked: `count` numbers, UINT8 ones whole and in 0..255."""
    kind = tensor.datatype
    if tensor.data is None:
        raise BadRequest(f"input {tensor.name!r}: no data")
    try:
        # FP32 straight to float32 (the hot path); UINT8 via float64 so that 255.5 or 1e300 are seen
        parse_as = np.float32 if kind == "FP32" else np.float64
        values: np.ndarray = np.asarray(tensor.data, dtype=parse_as).reshape(-1)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer literal beyond float range
        raise BadRequest(f"input {tensor.name!r}: data must be numbers within {kind} range") from None
    if values.size != count:
        raise BadRequest(f"input {tensor.name!r}: shape {tensor.shape} needs {count} values, got {values.size}")
    if kind != "UINT8":
        return values
    whole = bool(np.isfinite(values).all()) and not bool(np.any(np.mod(values, 1.0)))
    if not whole or (values.size and (values.min() < 0 or values.max() > 255)):
        raise BadRequest(f"input {tensor.name!r}: UINT8 values must be integers 0..255")
    return values.astype(np.uint8)


def _encoded_images(tensor: TensorInput, raw: bytes | None, max_images: int) -> list[bytes]:
    """A BYTES tensor [N] or [N, 1] of encoded image files: length-prefixed binary data or base64 in JSON."""
    shape = tensor.shape
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
        raise BadRequest(f"input {tensor.name!r}: BYTES shape must be [N] or [N, 1], got {shape}")
    if not 1 <= shape[0] <= max_images:
        raise BadRequest(f"input {tensor.name!r}: batch must be 1..{max_images}, got {shape[0]}")
    count = math.prod(shape)
    if raw is not None:
        return _split_bytes_elements(raw, count, tensor.name)
    if tensor.data is None:
        raise BadRequest(f"input {tensor.name!r}: no data")
    flat = np.asarray(tensor.data, dtype=object).reshape(-1).tolist()
    if len(flat) != count:
        raise BadRequest(f"input {tensor.name!r}: shape {shape} needs {count} elements, got {len(flat)}")
    return [_b64(item, f"input {tensor.name!r}") for item in flat]


def peek_images(images: list[tuple[bytes, Box | None]], max_pixels: int) -> list[tuple[Image.Image, Box | None]]:
    """Open encoded images, reading their headers only (cheap): formats and sizes are checked here."""
    opened = []
    for i, (data, box) in enumerate(images):
        try:
            opened.append((peek_image(data, max_pixels), box))
        except UnsupportedFormat as exc:
            raise BadRequest(f"image {i}: {exc}", 415) from None
        except BadImage as exc:
            raise BadRequest(f"image {i}: {exc}") from None
    return opened


def pixel_count(opened: list[tuple[Image.Image, Box | None]]) -> int:
    return sum(image.width * image.height for image, _ in opened)


def top_classes(probabilities: np.ndarray, classes: list[str], k: int) -> list[list[dict[str, Any]]]:
    """Per row of [N, C] probabilities, the `k` most likely classes (class_id, name, probability), best first;
    ties go to the lowest id, as argmax. /v1/predict answers with it, and `pipeline predict` prints it."""
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, : min(k, probabilities.shape[1])]
    return [
        [{"class_id": int(c), "name": classes[int(c)], "probability": float(row[c])} for c in best]
        for row, best in zip(probabilities, order, strict=True)
    ]


_CLOSED = Image.new("1", (1, 1))


def decode_opened(opened: list[tuple[Image.Image, Box | None]], framing: Framing) -> np.ndarray:
    """Images from `peek_images` -> float32 [N,3,S,S] in [0,1], through the model's framing (preprocess.Framing)."""
    out = np.empty((len(opened), 3, framing.size, framing.size), dtype=np.float32)
    for i, (image, box) in enumerate(opened):
        try:
            pixels = framing.decode(image, box)
        except BadImage as exc:
            raise BadRequest(f"image {i}: {exc}") from None
        finally:
            # Free each decoded image before the next: a request's peak memory is one image, not all of them.
            image.close()
            opened[i] = (_CLOSED, None)
        out[i] = pixels.transpose(2, 0, 1) / np.float32(255.0)
    return out


def decode_images(images: list[tuple[bytes, Box | None]], framing: Framing, max_pixels: int) -> np.ndarray:
    """Encoded images -> float32 [N,3,S,S] in [0,1], through the model's framing (preprocess.Framing)."""
    return decode_opened(peek_images(images, max_pixels), framing)


def multipart_files(body: bytes, content_type: str, max_files: int) -> list[bytes] | None:
    """The files of a plain multipart/form-data body, split with bytes.find: every part a file (a
    Content-Disposition with name and filename, at most a Content-Type besides), no preamble, no
    epilogue. None for anything else; the caller then runs the general parser (python-multipart through
    Starlette, with its limits and error messages), so this changes speed, never what is accepted."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary", b"")
    if not 1 <= len(boundary) <= 70:  # RFC 2046's limit
        return None
    delimiter = b"--" + boundary
    if not body.startswith(delimiter + b"\r\n"):
        return None
    files: list[bytes] = []
    pos = len(delimiter) + 2
    while len(files) < max_files:
        headers_end = body.find(b"\r\n\r\n", pos)
        if headers_end < 0 or not _is_plain_file_part(body[pos:headers_end]):
            return None
        data_end = body.find(b"\r\n" + delimiter, headers_end + 4)
        if data_end < 0:
            return None
        files.append(body[headers_end + 4 : data_end])
        pos = data_end + 2 + len(delimiter)
        after = body[pos : pos + 2]
        if after == b"--":
            return files if body[pos + 2 :] in (b"", b"\r\n") else None
        if after != b"\r\n":
            return None
        pos += 2
    return None  # more files than allowed: the general parser words the error


def _is_plain_file_part(headers: bytes) -> bool:
    disposition_seen = False
    for line in headers.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        name = name.lower()
        if not colon:
            return False
        if name == b"content-disposition" and not disposition_seen:
            kind, options = parse_options_header(value.lstrip(b" \t"))
            if kind != b"form-data" or b"name" not in options or b"filename" not in options:
                return False
            disposition_seen = True
        elif name != b"content-type":
            return False
    return disposition_seen


def parse_predict_json(body: bytes, max_images: int) -> tuple[list[tuple[bytes, Box | None]], int | None]:
    try:
        request = PredictRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadRequest(f"invalid request: {where}: {first['msg']}") from None
    if len(request.images) > max_images:
        raise BadRequest(f"at most {max_images} images per request, got {len(request.images)}")
    items: list[tuple[bytes, Box | None]] = []
    for i, item in enumerate(request.images):
        if isinstance(item, str):
            items.append((_b64(item, f"images.{i}"), None))
        else:
            items.append((_b64(item.data, f"images.{i}.data"), item.box))
    return items, request.top_k


def encode_outputs(outputs: dict[str, np.ndarray], binary: bool) -> tuple[list[dict[str, Any]], bytes]:
    """OIP output tensors, as JSON data or as binary chunks after the JSON header."""
    described, chunks = [], []
    for name, array in outputs.items():
        datatype = "FP32" if array.dtype == np.float32 else "INT64"
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = array.reshape(-1).tolist()
        described.append(entry)
    return described, b"".join(chunks)


def json_bytes(payload: Any) -> bytes:
    return orjson.dumps(payload)

"""Setup (c) of `python -m benchmarks serve`, for comparison only: the serving design of Arm's learning path
example that issue #6 names, reproduced here (written for this project, not copied) around OUR model.

The design, kept as it is there:
  - a FastAPI app with one `async def` route, `POST /predict/`, taking one uploaded file (multipart);
  - PIL decodes the upload, torchvision transforms make the tensor (Resize to the model's input size,
    ToTensor: RGB in [0, 1], which is what our network expects: it normalises inside);
  - one eager-PyTorch forward per request, batch 1, under torch.no_grad(), on the event loop;
  - the answer is {"predicted_class": <int>}.
What is ours: the trained fp32 network (models/model.pt, loaded through pipeline.runtimes.torch_models),
and the uvicorn it runs on (the same uvicorn[standard] as our server, uvloop + httptools, so the
comparison is of the serving design, not of the HTTP stack). PyTorch keeps its default threads.

    uv run python -m benchmarks.reference_server --port 8001      # then POST a file to /predict/
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, File, UploadFile
from PIL import Image
from torchvision import transforms

from pipeline.artifacts import model as model_file_format


def create_app(model_file: Path) -> FastAPI:
    model, payload = model_file_format.read(model_file)  # eval mode, fp32 as trained
    size = int(payload["arch"]["image_size"])
    to_tensor = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor()])
    app = FastAPI(title="reference: one eager-PyTorch forward per request")

    @app.post("/predict/")
    async def predict(file: UploadFile = File(...)) -> dict[str, int]:
        image = Image.open(io.BytesIO(await file.read())).convert("RGB")
        batch = to_tensor(image).unsqueeze(0)
        with torch.no_grad():
            logits = model(batch)
        return {"predicted_class": int(logits.argmax(dim=1).item())}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/model.pt"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = PyTorch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    uvicorn.run(create_app(args.model), host=args.host, port=args.port, access_log=False, log_level="warning")


if __name__ == "__main__":
    main()

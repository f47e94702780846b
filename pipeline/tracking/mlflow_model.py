"""A shipped variant as an MLflow model: `mlflow.pyfunc.load_model("models:/gtsrb-classifier@champion")`
classifies encoded image files (PNG, JPEG, PPM, ... whole, as users send them) exactly as the server does.

The model is logged *from code* (MLflow's models-from-code): this file is the model's definition, and loading
imports it instead of unpickling an object. Its artifacts are the variant file with the manifest naming it
(SHA-256 checked before any runtime opens the file), `variant.json` naming the variant, and `code/pipeline` (the
serving code it runs). Inside: `serve.model.load_served_model` and `serve.protocol.decode_images`, the same function objects as the server,
so the registry's model, `mlflow models serve`, MLServer's MLflow runtime and our server agree file for file.

Input: a DataFrame with a binary column `image` (or a list of bytes). Output: `class_id`, `class_name` and
`probability` of the top class per row. The framing contract (size, crop, normalisation) is in the model's
metadata, so a tensor client can reproduce it. `tracking.log_variant_model` logs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow.models
from mlflow.pyfunc import PythonModel


class ServedVariant(PythonModel):
    def load_context(self, context: Any) -> None:
        from pipeline.config import ServeConfig
        from pipeline.serve.model import load_served_model

        # The variant is named by a small JSON artifact (models logged before it: by model_config, which MLflow
        # also logs as run params, where the second variant of a run collides with the first).
        if "variant" in context.artifacts:
            variant = json.loads(Path(context.artifacts["variant"]).read_text())["variant"]
        else:
            variant = (context.model_config or {})["variant"]
        self.model = load_served_model(Path(context.artifacts["models"]), ServeConfig(variant=variant))

    # Untyped on purpose: MLflow would derive (and enforce) a schema from type hints; the signature is logged.
    def predict(self, context, model_input, params=None):
        import numpy as np
        import pandas as pd

        from pipeline.images.preprocess import MAX_PIXELS
        from pipeline.serve.protocol import decode_images

        images = list(model_input["image"]) if isinstance(model_input, pd.DataFrame) else list(model_input)
        if not images:
            return pd.DataFrame({"class_id": [], "class_name": [], "probability": []})
        arrays = decode_images([(bytes(b), None) for b in images], self.model.framing, MAX_PIXELS)
        probabilities = self.model.probabilities(arrays)
        best = probabilities.argmax(axis=1)
        return pd.DataFrame(
            {
                "class_id": best.astype(np.int64),
                "class_name": [self.model.classes[i] for i in best],
                "probability": probabilities[np.arange(len(best)), best].astype(np.float64),
            }
        )


mlflow.models.set_model(ServedVariant())

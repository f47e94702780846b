"""pipeline/tracking.py: what MLflow prints while a variant is logged."""

from __future__ import annotations

import warnings

from pipeline.tracking import quiet_mlflow_logging


def _define_untyped_model() -> None:
    """What models-from-code runs at every log and load: MLflow advises type hints for such a class."""
    from mlflow.pyfunc import PythonModel

    class Untyped(PythonModel):
        def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
            return model_input


def test_mlflows_advice_is_hidden_while_logging_and_other_warnings_are_not() -> None:
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_mlflow_logging():
            _define_untyped_model()
            warnings.warn("ours", UserWarning, stacklevel=1)
        hidden = [str(w.message) for w in shown]
        _define_untyped_model()  # outside the context the advice shows (so this test can fail)
        after = [str(w.message) for w in shown]
    assert "ours" in hidden and not any("type hints" in m for m in hidden)
    assert any("type hints" in m for m in after)

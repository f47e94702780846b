"""Which registry version the server runs: `pipeline serve --champion` downloads the registry's `champion` (the
variant file and its manifest, as optimize registered them) and checks the file by the sha256 the version is tagged
with; serving models/ looks its file up among the registered versions, so the log and `/v2/models/<name>` say
which version runs and whether it is the champion.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.artifacts.variants import MANIFEST_NAME
from pipeline.config import Params
from pipeline.errors import StageError
from pipeline.serve.model import RegistryVersion


def download_champion(params: Params) -> tuple[Path, str, RegistryVersion]:
    """The champion's models folder (manifest + its one variant file) in a fresh temporary folder, the variant's
    name and its registry version; a StageError when there is no registry, no champion, or a file that is not the
    one the version names."""
    import mlflow

    from pipeline.runtimes import read_manifest
    from pipeline.tracking import champion_version, quiet_mlflow_logging, tracking_uri

    name = params.tracking.registered_model_name
    if not params.tracking.enabled:
        raise StageError("--champion needs the model registry, and tracking.enabled is false")
    version = champion_version(params)
    if version is None:
        raise StageError(
            f"{name} has no `champion` in the registry at {tracking_uri(params.tracking)}: a run whose gate passes "
            "promotes one (evaluate.promote), or `pipeline promote --version N`; MLFLOW_TRACKING_URI names a team's"
        )
    variant, sha256 = version.tags.get("variant", ""), version.tags.get("sha256", "")
    target = Path(tempfile.mkdtemp(prefix="pipeline-champion-"))
    try:
        with quiet_mlflow_logging():
            folder = mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{name}/{version.version}",
                dst_path=str(target),
                tracking_uri=tracking_uri(params.tracking),
            )
    except mlflow.exceptions.MlflowException as exc:
        raise StageError(f"the champion ({name} version {version.version}) cannot be downloaded: {exc}") from None
    models = Path(folder) / "artifacts" / "models"
    if not (models / MANIFEST_NAME).is_file():
        raise StageError(f"{name} version {version.version} holds no models/{MANIFEST_NAME}: not a pipeline model")
    # The manifest must name the file the version is tagged with; opening it, the runtime checks the file against
    # the manifest's sha256 (pipeline.runtimes.open_runtime), so it is hashed once.
    shipped = read_manifest(models).variant(variant)
    if not sha256 or shipped.sha256 != sha256:
        raise StageError(
            f"{name} version {version.version}: its manifest names {variant} with sha256 {shipped.sha256[:12]}, the "
            f"version is tagged {sha256[:12] or 'with none'}: refused"
        )
    return models, variant, RegistryVersion(name, str(version.version), champion=True)


QUICK_TRY = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


@contextlib.contextmanager
def _one_quick_try() -> Iterator[None]:
    """A tracking server that does not answer delays the server's start by seconds, not by MLflow's minutes of
    retries: the lookup only names the version, it decides nothing."""
    saved = {k: os.environ.get(k) for k in QUICK_TRY}
    os.environ.update(QUICK_TRY)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def registered_as(params: Params, sha256: str) -> RegistryVersion | None:
    """The newest registered version of this file, and whether it is the champion; None without a registry that is
    already there (the server never creates a store), or when no version holds this file."""
    from pipeline.tracking import tracking_uri

    uri = tracking_uri(params.tracking)
    local = uri.startswith("sqlite:///")
    if not params.tracking.enabled or (local and not Path(uri[len("sqlite:///") :]).is_file()):
        return None
    if not local and not os.environ.get("MLFLOW_TRACKING_URI"):
        return None  # a configured server that may be far away: only when the environment names it
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    name = params.tracking.registered_model_name
    try:
        with _one_quick_try():
            found = client.search_model_versions(f"name='{name}'")
    except mlflow.exceptions.MlflowException:
        return None
    versions = [v for v in found if v.tags.get("sha256") == sha256]
    if not versions:
        return None
    try:
        with _one_quick_try():
            champion = client.get_model_version_by_alias(name, "champion").version
    except mlflow.exceptions.MlflowException:
        champion = None  # no champion yet
    newest = max(versions, key=lambda v: int(v.version))
    same = champion is not None and any(str(v.version) == str(champion) for v in versions)
    return RegistryVersion(name, str(champion if same else newest.version), champion=same)

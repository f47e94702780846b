"""The Kubernetes manifests in deploy/k8s: valid against the Kubernetes JSON schemas (offline, through the
`kubernetes-validate` package, which bundles them), and consistent with the server image."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.helpers import REPO

K8S = REPO / "deploy" / "k8s"
# Kubernetes releases to check against: the oldest still common and the newest bundled.
VERSIONS = ("1.30", "latest")


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in documents() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (bundled schemas) not installed")
    target = kv.latest_version() if version == "latest" else version
    kinds = set()
    for name, doc in documents():
        try:
            kv.validate(doc, target, strict=True)  # strict: unknown fields are errors too
        except kv.ValidationError as exc:
            pytest.fail(f"{name} ({doc.get('kind')}) is not valid for Kubernetes {target}: {exc.message}")
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= kinds


def test_schema_validation_catches_mistakes() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (bundled schemas) not installed")
    broken = by_kind("Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)
    typo = by_kind("Service")
    typo["spec"]["prots"] = typo["spec"].pop("ports")
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, kv.latest_version(), strict=True)


def test_deployment_matches_the_image() -> None:
    deployment = by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    # Probes on the server's health routes, on the port the image listens on.
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert server["ports"][0]["containerPort"] == 8000 and "EXPOSE 8000" in dockerfile
    # Hardened as the image allows: non-root (the image's numeric user), read-only root, /tmp writable.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"USER {pod['securityContext']['runAsUser']}:" in dockerfile
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert server["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in server["volumeMounts"]} == {"/tmp"}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(server["resources"][kind])
    # Every object selects the same pods; the HPA scales this Deployment.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert by_kind("Service")["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gtsrb-server"}
    assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


# ------------------------------------------------- Kubeflow TrainJob, KServe ServingRuntime + InferenceService

CRD_MANIFESTS = {
    "deploy/kubeflow/trainjob.yaml": "trainjob-v1alpha1",
    "deploy/kserve/servingruntime.yaml": "servingruntime-v1alpha1",
    "deploy/kserve/inferenceservice.yaml": "inferenceservice-v1beta1",
}


def _strict(schema: Any) -> Any:
    """As `kubectl apply --validate=strict` treats a CRD: unknown fields are errors (the API server would
    silently prune them), except where the schema keeps unknown fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_errors(doc: dict[str, Any], schema_name: str) -> list[str]:
    import json

    import jsonschema

    schema = _strict(json.loads((REPO / "deploy" / "schemas" / f"{schema_name}.json").read_text()))
    return [
        f"{'.'.join(map(str, e.path))}: {e.message[:200]}" for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]


@pytest.mark.parametrize("path", sorted(CRD_MANIFESTS))
def test_kubeflow_and_kserve_manifests_match_their_published_crd_schemas(path: str) -> None:
    doc = yaml.safe_load((REPO / path).read_text())
    assert _crd_errors(doc, CRD_MANIFESTS[path]) == []


def test_crd_validation_catches_mistakes() -> None:
    trainjob = yaml.safe_load((REPO / "deploy/kubeflow/trainjob.yaml").read_text())
    trainjob["spec"]["trainer"]["numNode"] = 2  # a typo: the API server would drop it and train on one node
    trainjob["spec"]["trainer"]["numProcPerNode"] = "two"
    errors = _crd_errors(trainjob, "trainjob-v1alpha1")
    assert any("numNode" in e for e in errors) and any("numProcPerNode" in e for e in errors), errors
    isvc = yaml.safe_load((REPO / "deploy/kserve/inferenceservice.yaml").read_text())
    isvc["spec"]["predictor"]["model"]["protocolVersion"] = 2
    assert any("protocolVersion" in e for e in _crd_errors(isvc, "inferenceservice-v1beta1"))


def test_kserve_runtime_and_service_agree_with_the_server_image() -> None:
    """The InferenceService asks for the runtime and format the ServingRuntime offers, OIP v2; the runtime's
    container serves on KServe's port through the image's $PORT and probes the server's health routes."""
    runtime = yaml.safe_load((REPO / "deploy/kserve/servingruntime.yaml").read_text())
    isvc = yaml.safe_load((REPO / "deploy/kserve/inferenceservice.yaml").read_text())
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "v2"
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert "v2" in runtime["spec"]["protocolVersions"]
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PORT"] == "8080" and container["ports"][0]["containerPort"] == 8080
    assert '--port \\"$PORT\\"' in (REPO / "docker/Dockerfile").read_text()
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    trainjob = yaml.safe_load((REPO / "deploy/kubeflow/trainjob.yaml").read_text())
    script = trainjob["spec"]["trainer"]["command"][-1]
    assert "torchrun -m pipeline.cli train" in script and "models/checkpoints" in script


def test_the_deployment_turns_auth_on_from_a_secret_and_probes_stay_open() -> None:
    from pipeline.serve.access import is_open

    (container,) = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    token = env["PIPELINE_SERVE_TOKEN"]
    assert "value" not in token and token["valueFrom"]["secretKeyRef"]["name"] == "gtsrb-server-auth"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert is_open(container[probe]["httpGet"]["path"]), probe

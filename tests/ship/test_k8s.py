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

"""deploy/kubernetes/: every manifest is valid against the Kubernetes schemas (kubernetes-validate's bundled ones,
offline, strict: an unknown or misspelt field fails) and the pieces fit together (probes, ports, labels, GPUs)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install 'capserve[test]'")


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in MANIFESTS:
        found += [(f"{path.name}#{i}", doc) for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc]
    return found


def kinds() -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in documents()}


def test_there_are_manifests():
    expected = {
        ("Deployment", "capserve-gpu"),
        ("Deployment", "capserve-cpu"),
        ("Service", "capserve"),
        ("HorizontalPodAutoscaler", "capserve-cpu"),
    }
    assert set(kinds()) >= expected


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[name for name, _ in documents()])
def test_manifest_is_valid_against_the_kubernetes_schema_offline(name, doc, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("kubernetes-validate tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    version = kubernetes_validate.utils.latest_version()
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{name}: {e.message} at {'.'.join(map(str, e.path))}")


def test_the_validator_rejects_a_misspelt_field():
    """The check above can fail: a typo inside a container spec is refused."""
    doc = kinds()[("Deployment", "capserve-cpu")]
    container = dict(doc["spec"]["template"]["spec"]["containers"][0], readinesProbe={"httpGet": {"path": "/readyz"}})
    broken = {
        **doc,
        "spec": {**doc["spec"], "template": {**doc["spec"]["template"], "spec": {"containers": [container]}}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.utils.latest_version(), strict=True)


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_deployments_probe_capserve_and_the_service_reaches_them(variant):
    found = kinds()
    deployment = found[("Deployment", f"capserve-{variant}")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 3000}, "BentoML serves on 3000 in the containerized bento"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["CAPSERVE_WORKERS"] == "auto"
    assert env["CAPSERVE_DEVICE"] == ("cuda" if variant == "gpu" else "cpu")
    assert container["image"].rsplit("/", 1)[1].split(":")[0] == ("capserve" if variant == "gpu" else "capserve-cpu")
    limits = container["resources"]["limits"]
    if variant == "gpu":
        assert (
            int(limits["nvidia.com/gpu"]) >= 1
            and limits["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
        )
    else:
        assert "nvidia.com/gpu" not in limits and limits["cpu"] == container["resources"]["requests"]["cpu"]
    service = found[("Service", "capserve")]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)


def test_autoscalers_target_the_deployments():
    found = kinds()
    hpas = [doc for (kind, _), doc in found.items() if kind == "HorizontalPodAutoscaler"]
    assert hpas
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) in found and target["apiVersion"] == "apps/v1"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]

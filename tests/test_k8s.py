"""Kubernetes manifests for replicas (`trtkv triton-repo --k8s`), validated against the Kubernetes JSON schema offline."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from trtkv.errors import TrtkvError
from trtkv.triton_repo.interface import KV_BLOCKS_METRIC
from trtkv.triton_repo.k8s import KV_USAGE_METRIC, QUEUE_TIME_METRIC, K8sOptions, manifests
from trtkv.triton_repo.server import GRPC_PORT, HTTP_PORT, METRICS_PORT

K8S_VERSION = kubernetes_validate.latest_version()  # the newest release whose schema the package ships

OPTIONS = {
    "gpu-volume": K8sOptions(),
    "cpu-s3": K8sOptions(name="smollm2-int4", repository="s3://bucket/repo", storage_secret="s3-creds", gpus=0, replicas=2, max_replicas=8),
    "gpu-gcs": K8sOptions(repository="gs://bucket/trtkv/repo", gpus=2),
}


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("case", OPTIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(case):
    docs = manifests(OPTIONS[case])
    assert list(docs) == ["deployment.yaml", "service.yaml", "hpa.yaml", "prometheus-adapter.yaml"]
    for doc in docs.values():
        validate(doc)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["spec"].__setitem__("replicas", "two"),  # wrong type
        lambda d: d["spec"]["template"]["spec"].__setitem__("container", []),  # unknown field (strict)
        lambda d: d["spec"].pop("selector"),  # a required field
    ],
)
def test_the_validator_refuses_a_broken_deployment(mutate):
    doc = copy.deepcopy(manifests(K8sOptions())["deployment.yaml"])
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(doc)


def test_deployment_probes_ports_repository_and_gpus():
    dep = manifests(OPTIONS["gpu-volume"])["deployment.yaml"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": HTTP_PORT, "grpc": GRPC_PORT, "metrics": METRICS_PORT}
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert "--model-repository=/models" in c["args"] and "--strict-readiness=true" in c["args"]
    assert c["volumeMounts"][0]["mountPath"] == "/models" and pod["volumes"][0]["persistentVolumeClaim"]["readOnly"]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]

    s3 = manifests(OPTIONS["cpu-s3"])["deployment.yaml"]["spec"]["template"]["spec"]
    (c,) = s3["containers"]
    assert "--model-repository=s3://bucket/repo" in c["args"] and "volumes" not in s3 and "volumeMounts" not in c
    assert c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert "nvidia.com/gpu" not in str(c["resources"]) and "tolerations" not in s3


def test_service_reaches_the_deployments_pods():
    docs = manifests(OPTIONS["cpu-s3"])
    svc, dep = docs["service.yaml"], docs["deployment.yaml"]
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    named = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == named


def test_autoscaler_reads_the_metrics_the_adapter_publishes():
    docs = manifests(OPTIONS["cpu-s3"])
    hpa = docs["hpa.yaml"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs["deployment.yaml"]["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    wanted = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert wanted == {KV_USAGE_METRIC: "800m", QUEUE_TIME_METRIC: "50000"}
    rules = yaml.safe_load(docs["prometheus-adapter.yaml"]["data"]["config.yaml"])["rules"]
    assert {r["name"]["as"] for r in rules} == set(wanted)
    usage = next(r for r in rules if r["name"]["as"] == KV_USAGE_METRIC)
    assert usage["seriesQuery"].startswith(KV_BLOCKS_METRIC) and 'state="used"' in usage["metricsQuery"]


@pytest.mark.parametrize(
    "opts, match",
    [
        (K8sOptions(name="TRTKV"), "uppercase"),
        (K8sOptions(name="9lives"), "Kubernetes name"),
        (K8sOptions(replicas=5, max_replicas=4), "--max-replicas"),
        (K8sOptions(repository="http://host/repo"), "s3://"),
        (K8sOptions(kv_usage_target=1.5), r"\(0, 1\]"),
        (K8sOptions(gpus=-1), "negative"),
    ],
)
def test_bad_options_are_one_clear_error(opts, match):
    with pytest.raises(TrtkvError, match=match):
        manifests(opts)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, tiny_models):
    from trtkv.builder.build import build_engine

    model_dir, _ = tiny_models("llama", with_tokenizer=True)
    out = tmp_path_factory.mktemp("k8s") / "engine"
    return build_engine(str(model_dir), None, "fp16", out, backend="onnxruntime", block_size=16, max_seq_len=64, max_batch=2)


def test_cli_writes_a_movable_repository_and_valid_manifests(tiny_engine, tmp_path):
    from typer.testing import CliRunner

    from trtkv.cli import app

    res = CliRunner().invoke(app, ["triton-repo", str(tiny_engine), "--out", str(tmp_path / "repo"), "--k8s", str(tmp_path / "k8s"),
                                   "--repo-url", "s3://bucket/repo", "--replicas", "2", "--max-replicas", "3"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "repo/ensemble/1/engine/manifest.json").is_file()  # the engine travels inside the repository
    assert "KIND_GPU" in (tmp_path / "repo/ensemble/config.pbtxt").read_text()  # the replicas' GPUs, not this machine's
    for name in ("deployment.yaml", "service.yaml", "hpa.yaml", "prometheus-adapter.yaml"):
        validate(yaml.safe_load((tmp_path / "k8s" / name).read_text()))
    assert "FROM nvcr.io/nvidia/tritonserver" in (tmp_path / "k8s/Dockerfile").read_text()
    assert "kubectl apply" in res.output

    bad = CliRunner().invoke(app, ["triton-repo", str(tiny_engine), "--out", str(tmp_path / "repo2"), "--k8s", str(tmp_path / "k8s2"),
                                   "--replicas", "5", "--max-replicas", "2"])
    assert bad.exit_code == 2 and "--max-replicas" in bad.output
    assert not (tmp_path / "repo2").exists() and not (tmp_path / "k8s2").exists()  # refused before anything was written

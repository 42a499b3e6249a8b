"""Kubernetes manifests for replicas of a generated model repository (`trtkv triton-repo ENGINE --k8s DIR`).

Beyond one machine the engine that scales is Triton itself: each replica is one tritonserver pod reading the
same model repository, from object storage (``s3://``, ``gs://``, ``as://``: tritonserver reads them natively)
or from a volume. What is written (docs/deploy.md):

    DIR/deployment.yaml           the tritonserver pods: probes on Triton's health endpoints, GPUs, the repository
    DIR/service.yaml              one address for HTTP, gRPC and metrics in front of the replicas
    DIR/hpa.yaml                  autoscaling/v2 on the KV pool usage and Triton's queue time per request
    DIR/prometheus-adapter.yaml   the two custom metrics the HPA reads, as prometheus-adapter rules (a ConfigMap)
    DIR/Dockerfile                NVIDIA's Triton image plus trtkv: the image the deployment names

Every manifest is validated against the Kubernetes JSON schema (``kubernetes-validate``, offline) in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trtkv import __version__
from trtkv.errors import TrtkvError
from trtkv.triton_repo.interface import KV_BLOCKS_METRIC
from trtkv.triton_repo.server import GRPC_PORT, HTTP_PORT, METRICS_PORT

KV_USAGE_METRIC = "trtkv_kv_pool_usage"  # used / all pool blocks of a pod, from the trtkv_kv_blocks gauges
QUEUE_TIME_METRIC = "triton_queue_time_us"  # mean queue time per request over a minute, from Triton's counters
OBJECT_STORES = ("s3://", "gs://", "as://")
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51, the server version trtkv is tested with
REPO_MOUNT = "/models"


@dataclass(frozen=True)
class K8sOptions:
    """What a deployment of the repository needs to know; the defaults make a one-GPU replica set of 1..4."""

    name: str = "trtkv"
    image: str = f"trtkv-tritonserver:{__version__}"
    repository: str = REPO_MOUNT  # s3:// / gs:// / as:// URL, or a path inside the volume ``repository_claim``
    repository_claim: str = "trtkv-model-repository"  # PersistentVolumeClaim holding the repository (path repositories)
    storage_secret: str | None = None  # Secret with the object store's credentials (AWS_ACCESS_KEY_ID, ...), as env
    replicas: int = 1
    max_replicas: int = 4
    gpus: int = 1  # per replica; 0 serves on CPU (KIND_CPU instances)
    kv_usage_target: float = 0.8  # scale out when the pods' KV pools are this full on average
    queue_time_target_us: int = 50_000  # ... or requests wait this long in Triton's queue on average

    def check(self) -> None:
        if not self.name or not all(c.isalnum() or c == "-" for c in self.name) or not self.name[0].isalpha():
            raise TrtkvError(f"--k8s-name {self.name!r} is not a Kubernetes name", "use lowercase letters, digits and '-', starting with a letter")
        if self.name != self.name.lower():
            raise TrtkvError(f"--k8s-name {self.name!r} has uppercase letters", f"use {self.name.lower()!r}")
        if not 1 <= self.replicas <= self.max_replicas:
            raise TrtkvError(f"replicas {self.replicas} .. {self.max_replicas} is not a range", "give 1 <= --replicas <= --max-replicas")
        if self.gpus < 0:
            raise TrtkvError(f"--gpus {self.gpus} is negative", "give GPUs per replica, 0 for CPU")
        if not 0 < self.kv_usage_target <= 1:
            raise TrtkvError(f"KV usage target {self.kv_usage_target} is not in (0, 1]", "e.g. 0.8 scales out at 80 % pool usage")
        if "://" in self.repository and not self.repository.startswith(OBJECT_STORES):
            raise TrtkvError(f"repository {self.repository!r}: tritonserver reads {', '.join(OBJECT_STORES)} and local paths",
                             "upload the repository to S3 / GCS / Azure storage, or mount it and give its path")

    @property
    def from_object_store(self) -> bool:
        return self.repository.startswith(OBJECT_STORES)


def _labels(o: K8sOptions) -> dict:
    return {"app.kubernetes.io/name": o.name, "app.kubernetes.io/component": "tritonserver", "app.kubernetes.io/part-of": "trtkv"}


def _object(o: K8sOptions, api: str, kind: str, spec_or_data: dict, *, suffix: str = "", key: str = "spec") -> dict:
    """A Kubernetes object of this deployment: its apiVersion, kind, name (``o.name`` + suffix), labels and body."""
    return {"apiVersion": api, "kind": kind, "metadata": {"name": o.name + suffix, "labels": _labels(o)}, key: spec_or_data}


def _probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 5}


def deployment(o: K8sOptions) -> dict:
    args = [
        "tritonserver",
        f"--model-repository={o.repository}",
        "--strict-readiness=true",  # not ready until every model is: the readiness probe then means "can serve"
        "--exit-on-error=true",  # a model that fails to load ends the pod, and Kubernetes restarts it
        f"--http-port={HTTP_PORT}", f"--grpc-port={GRPC_PORT}", f"--metrics-port={METRICS_PORT}",
    ]
    container: dict = {
        "name": "tritonserver",
        "image": o.image,
        "args": args,
        "ports": [{"name": "http", "containerPort": HTTP_PORT}, {"name": "grpc", "containerPort": GRPC_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT}],
        # model load (the engine, the KV pool) can take minutes: startup allows 10, then liveness takes over
        "startupProbe": _probe("/v2/health/live", 10, 60),
        "livenessProbe": _probe("/v2/health/live", 10, 3),
        "readinessProbe": _probe("/v2/health/ready", 5, 2),
        "resources": {"limits": {"nvidia.com/gpu": o.gpus}} if o.gpus else {"requests": {"cpu": "2", "memory": "8Gi"}},
    }
    pod: dict = {"containers": [container], "terminationGracePeriodSeconds": 60}  # SIGTERM drains in-flight requests
    if o.storage_secret:
        container["envFrom"] = [{"secretRef": {"name": o.storage_secret}}]
    if not o.from_object_store:
        container["volumeMounts"] = [{"name": "model-repository", "mountPath": REPO_MOUNT, "readOnly": True}]
        pod["volumes"] = [{"name": "model-repository", "persistentVolumeClaim": {"claimName": o.repository_claim, "readOnly": True}}]
    if o.gpus:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return _object(o, "apps/v1", "Deployment", {
        "replicas": o.replicas,
        "selector": {"matchLabels": _labels(o)},
        "template": {
            "metadata": {"labels": _labels(o), "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}},
            "spec": pod,
        },
    })


def service(o: K8sOptions) -> dict:
    return _object(o, "v1", "Service", {
        "selector": _labels(o),
        "ports": [{"name": n, "port": p, "targetPort": n} for n, p in (("http", HTTP_PORT), ("grpc", GRPC_PORT), ("metrics", METRICS_PORT))],
    })


def _pods_metric(name: str, average: str) -> dict:
    return {"type": "Pods", "pods": {"metric": {"name": name}, "target": {"type": "AverageValue", "averageValue": average}}}


def autoscaler(o: K8sOptions) -> dict:
    return _object(o, "autoscaling/v2", "HorizontalPodAutoscaler", {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": o.name},
        "minReplicas": o.replicas,
        "maxReplicas": o.max_replicas,
        "metrics": [
            _pods_metric(KV_USAGE_METRIC, f"{round(o.kv_usage_target * 1000)}m"),
            _pods_metric(QUEUE_TIME_METRIC, str(o.queue_time_target_us)),
        ],
        # a new replica loads an engine: scale out fast, scale in slowly so that warm pools are kept
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
    })


def adapter_rules(o: K8sOptions) -> dict:
    """prometheus-adapter rules that publish the two metrics the HPA reads (merge into the adapter's config)."""
    pod = "resources:\n    overrides: {namespace: {resource: namespace}, pod: {resource: pod}}\n"
    rules = (
        "rules:\n"
        f"- seriesQuery: '{KV_BLOCKS_METRIC}{{namespace!=\"\",pod!=\"\"}}'\n  {pod}"
        f"  name: {{as: \"{KV_USAGE_METRIC}\"}}\n"
        f"  metricsQuery: 'sum({KV_BLOCKS_METRIC}{{state=\"used\",<<.LabelMatchers>>}}) by (<<.GroupBy>>) / "
        f"sum({KV_BLOCKS_METRIC}{{<<.LabelMatchers>>}}) by (<<.GroupBy>>)'\n"
        f"- seriesQuery: 'nv_inference_queue_duration_us{{namespace!=\"\",pod!=\"\"}}'\n  {pod}"
        f"  name: {{as: \"{QUEUE_TIME_METRIC}\"}}\n"
        "  metricsQuery: 'sum(rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>) / "
        "clamp_min(sum(rate(nv_inference_request_success{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>), 1)'\n"
    )
    return _object(o, "v1", "ConfigMap", {"config.yaml": rules}, suffix="-prometheus-adapter-rules", key="data")


def dockerfile(o: K8sOptions) -> str:
    return (
        f"# The image {o.image}: NVIDIA's Triton server with trtkv for the python-backend model.\n"
        f"# docker build -t {o.image} . && docker push {o.image}\n"
        f"FROM {TRITON_IMAGE}\n"
        f"RUN pip install --no-cache-dir 'trtkv[onnx,kernels]=={__version__}'\n"
    )


def manifests(o: K8sOptions) -> dict[str, dict]:
    """File name -> manifest, in the order they are applied."""
    o.check()
    return {"deployment.yaml": deployment(o), "service.yaml": service(o), "hpa.yaml": autoscaler(o),
            "prometheus-adapter.yaml": adapter_rules(o)}


def write_k8s(out: Path | str, o: K8sOptions) -> list[Path]:
    """Write the manifests and the Dockerfile into ``out`` (created; existing files of these names replaced)."""
    import yaml

    out = Path(out)
    docs = manifests(o)
    try:
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, doc in docs.items():
            tmp = out / f".{name}.tmp"
            tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
            tmp.replace(out / name)
            written.append(out / name)
        (out / "Dockerfile").write_text(dockerfile(o))
    except OSError as exc:
        raise TrtkvError(f"cannot write the Kubernetes manifests to {out}: {exc.strerror}", "choose a writable --k8s folder") from None
    return [*written, out / "Dockerfile"]

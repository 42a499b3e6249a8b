"""Find, start, wait for and stop ``tritonserver`` on a generated repository.

The server binary is ``$TRITONSERVER``, else ``tritonserver`` on PATH (NGC containers), else the one
bundled in ``nvidia-pytriton`` (2.51, python backend only). For the bundled one a backend directory
is assembled from three links into the wheel, the venv's ``bin/`` goes first on PATH and the
interpreter's LIBDIR onto LD_LIBRARY_PATH, so the python-backend stub runs this interpreter's
environment (numpy < 2, trtkv). Every server gets its own shared-memory prefix.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trtkv.errors import TrtkvError


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    bundled: bool  # from nvidia-pytriton: needs our backend directory and environment


def find_tritonserver() -> ServerBinary:
    env = os.environ.get("TRITONSERVER")
    if env:
        p = Path(env)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise TrtkvError(f"$TRITONSERVER={env} is not an executable file", "point it at a tritonserver binary or unset it")
        return ServerBinary(p, bundled=_is_bundled(p))
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerBinary(Path(on_path), bundled=_is_bundled(Path(on_path)))
    bundled = _bundled_dir() / "bin" / "tritonserver"
    if bundled.is_file():
        return ServerBinary(bundled, bundled=True)
    raise TrtkvError(
        "no tritonserver found ($TRITONSERVER, PATH, nvidia-pytriton)",
        "install the serve extra (pip install 'trtkv[serve]' nvidia-pytriton==0.7.0) or run inside NVIDIA's Triton container",
    )


def _bundled_dir() -> Path:
    try:
        import pytriton
    except ImportError:
        return Path("/nonexistent")
    return Path(pytriton.__file__).parent / "tritonserver"


def _is_bundled(p: Path) -> bool:
    try:
        return p.resolve().is_relative_to(_bundled_dir().resolve())
    except OSError:
        return False


def bundled_backend_dir(dest: Path) -> Path:
    """``dest/python/`` with the python backend library, its utils and the stub for this interpreter."""
    root = _bundled_dir()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    links = {
        "libtriton_python.so": root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": root / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": root / "python_backend_stubs" / ver / "triton_python_backend_stub",
    }
    for target in links.values():
        if not target.exists():
            raise TrtkvError(f"the bundled Triton lacks {target}", "use Python 3.8-3.13 with nvidia-pytriton==0.7.0, or a tritonserver on PATH")
    (dest / "python").mkdir(parents=True, exist_ok=True)
    for name, target in links.items():
        link = dest / "python" / name
        if not link.exists():
            link.symlink_to(target)
    return dest


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host != "0.0.0.0" else "", port))
        except OSError:
            return False
    return True


HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002  # tritonserver's own defaults


FREE_PORTS = range(20000, 32768)  # below Linux's default ephemeral range (32768-60999), where connections take source ports


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started next. Drawn at random from ``FREE_PORTS``, not the kernel's
    ephemeral range (``bind(0)``): a port from there can be taken, before the server binds it, as the source port of
    any outgoing connection on the machine (a parallel test run's clients did: tritonserver then fails with 'Address
    already in use'). The system's random source: processes seeded alike (test workers) draw different ports."""
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(FREE_PORTS.start, FREE_PORTS.stop)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every draw taken: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def metric_values(metrics_url: str, name: str, **labels: str) -> list[float]:
    """The values of one metric family at ``metrics_url`` (Prometheus text), one per series whose labels include ``labels``."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(w in line for w in want)
    ]


@dataclass
class TritonServer:
    """A running tritonserver; use as a context manager or call ``stop()``."""

    repo: Path
    host: str = "127.0.0.1"
    http_port: int = HTTP_PORT
    grpc_port: int = GRPC_PORT
    metrics_port: int = METRICS_PORT
    log_file: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    _tmp: tempfile.TemporaryDirectory | None = None
    shm_prefix: str = ""
    model_pids: list[int] = field(default_factory=list)  # the python backend stubs (the model processes) once ready

    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"http://{self.client_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def metric_values(self, name: str, **labels: str) -> list[float]:
        """The values of one metric family from /metrics, one per series whose labels include ``labels``."""
        return metric_values(self.metrics_url, name, **labels)

    def wait_for_metric(self, name: str, at_least: float, timeout: float = 10.0, **labels: str) -> float:
        """Poll until the metric reaches ``at_least`` (custom metrics are pushed asynchronously); its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = max(self.metric_values(name, **labels), default=float("-inf"))
            if value >= at_least or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def command(self, binary: ServerBinary, backend_dir: Path | None, shm_prefix: str) -> list[str]:
        cmd = [
            str(binary.path),
            f"--model-repository={self.repo}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--exit-on-error=true", "--strict-readiness=true",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
            "--log-verbose=0",
        ]  # fmt: skip
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        if not _has_gpu():
            cmd += ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        return cmd + self.extra_args

    def start(self, timeout: float = 180.0) -> "TritonServer":
        for name, port in (("http", self.http_port), ("grpc", self.grpc_port), ("metrics", self.metrics_port)):
            if not port_free(self.host, port):
                raise TrtkvError(f"{name} port {port} on {self.host} is in use", f"stop what is listening there or pass --{name}-port")
        binary = find_tritonserver()
        env = {**os.environ, **self.extra_env}
        backend_dir = None
        if binary.bundled:
            self._tmp = tempfile.TemporaryDirectory(prefix="trtkv-triton-")
            backend_dir = bundled_backend_dir(Path(self._tmp.name))
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
            libdir = sysconfig.get_config_var("LIBDIR") or ""
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        shm_prefix = self.shm_prefix = f"trtkv{uuid.uuid4().hex[:10]}_"
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command(binary, backend_dir, shm_prefix), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.model_pids = [pid for pid in child_pids(self.process.pid) if STUB_NAME in _cmdline(pid)]
        for region in Path("/dev/shm").glob(f"{shm_prefix}*"):  # the python backend makes them world-readable (0666)
            try:
                region.chmod(0o600)
            except OSError:
                pass
        return self

    def dead_model_pids(self) -> list[int]:
        """Model processes (python backend stubs) that died since the server became ready. Triton 2.51 does
        not notice: it keeps answering ready and leaves the dead stub's streams hanging."""
        return [pid for pid in self.model_pids if _proc_state(pid) in (None, "Z", "X")]

    def remove_shared_memory(self) -> list[str]:
        """Remove this server's /dev/shm regions (left behind when it is killed); the names removed."""
        if not self.shm_prefix:
            return []
        removed = []
        for p in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            try:
                p.unlink()
                removed.append(p.name)
            except OSError:
                pass
        return removed

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise TrtkvError(
                    f"tritonserver exited with code {self.process.returncode} while loading {self.repo}"
                    + (f" (log: {self.log_file}: {tail(self.log_file)})" if self.log_file else ""),
                    "check the engine directory and the server log",
                )
            try:
                with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TrtkvError(f"tritonserver was not ready after {timeout:.0f} s", "check the server log (--log-file)")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGINT, then SIGKILL after ``timeout`` s (0: at once); its shared memory is removed either way."""
        p, self.process = self.process, None
        rc = None
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGINT if timeout > 0 else signal.SIGKILL)
                rc = p.wait(timeout if timeout > 0 else 10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait(5)
            except ProcessLookupError:
                pass
        elif p is not None:
            rc = p.returncode
        if p is not None:  # the model processes (python backend stubs) of a tritonserver that exited at the end of its
            try:  # exit timeout (code 1) outlive it: its process group goes with it
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.remove_shared_memory()
        self.model_pids = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return rc

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


STUB_NAME = "triton_python_backend_stub"
DRAIN_GRACE_ENV = "TRTKV_DRAIN_GRACE_S"  # seconds the model lets requests in flight finish at shutdown (`trtkv serve --grace`)
DRAIN_FILE_ENV = "TRTKV_DRAIN_FILE"  # `trtkv serve` writes the grace (seconds) here to start a drain; the model answers in FILE.done


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _proc_state(pid: int) -> str | None:
    """One-letter process state from /proc (R, S, Z, ...), None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def tail(path: Path | None, n: int = 600) -> str:
    if path is None or not Path(path).is_file():
        return ""
    text = Path(path).read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("E") or "error" in line.lower()]
    return " | ".join(errors[-3:])[-n:] if errors else text[-n:].replace("\n", " | ")


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False

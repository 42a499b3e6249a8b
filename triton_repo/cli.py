"""``trtkv serve``, ``trtkv triton-repo`` and ``trtkv generate`` (registered on the main app by trtkv.cli)."""

from __future__ import annotations

import inspect
import os
import signal
import sys
import time
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from trtkv.cli_options import field_option
from trtkv.errors import TrtkvError
from trtkv.runtime.config import RuntimeConfig

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

InstancesOpt = Annotated[int, typer.Option("--instances", help="engines (Triton model instances) in this server; the KV budget is split among them")]

# The RuntimeConfig fields that `triton-repo` and `serve` take as options, their flags, help and defaults generated from
# the fields (trtkv.cli_options.field_option); `device` is not one: the repository writes the instance kind's.
RUNTIME_OPTIONS = ("kv_memory_gib", "reserve", "max_seqs", "max_batched_tokens", "backend", "attention", "cpu_threads", "enable_prefix_caching",
                   "free_window_blocks", "deterministic")
# `generate --engine` runs one prompt offline: four slots and a small pool that loads fast. Its own, named defaults
# (the options and their help take them from here, and so does the run).
GENERATE_CONFIG = RuntimeConfig(kv_memory_gib=0.25, max_seqs=4)
GENERATE_OPTIONS = ("kv_memory_gib", "backend", "attention", "cpu_threads")


def runtime_options(names, base: RuntimeConfig) -> tuple:
    """``(name, annotation, default)`` of the options for RuntimeConfig fields ``names``, defaults from ``base``."""
    return tuple((name, *field_option(RuntimeConfig, name, getattr(base, name))) for name in names)


# The repository's options: `triton-repo` and `serve` both write a repository, so both take these (declared once).
REPO_OPTIONS = (
    *runtime_options(RUNTIME_OPTIONS, RuntimeConfig()),
    ("instances", InstancesOpt, 1),
    ("instance_kind", Annotated[str, typer.Option(help="auto | cpu | gpu (KIND_CPU / KIND_GPU instances)")], "auto"),
    ("copy_engine", Annotated[bool, typer.Option(help="copy the engine into the repository instead of referencing its path")], False),
)


def with_options(options):
    """Give a command ``options`` (``(name, annotation, default)``) as keyword parameters (typer reads the signature);
    it receives them in its ``**kwargs``."""

    def add(command):
        sig = inspect.signature(command)
        # the command's own annotations are strings here (from __future__ import annotations); typer would read an
        # unresolved string as a plain option named after the parameter, losing its flags ("-n") and help
        hints = typing.get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann) for name, ann, default in options]
        command.__signature__ = sig.replace(parameters=own + added)
        command.__annotations__ = {**command.__annotations__, **{name: ann for name, ann, _ in options}}
        return command

    return add


with_repo_options = with_options(REPO_OPTIONS)


def _repo_options(*, instances, instance_kind, copy_engine, **runtime):
    """The command's options -> RepoOptions; RuntimeConfig validates the runtime ones (one line naming the flag)."""
    from trtkv.triton_repo.repository import RepoOptions

    if instances < 1:
        raise TrtkvError(f"--instances must be at least 1, got {instances}", "pass a positive integer")
    return RepoOptions(runtime=RuntimeConfig(**runtime), instance_kind=instance_kind, instances=instances, copy_engine=copy_engine)


def _warn_batch(m, runtime: RuntimeConfig) -> None:
    """Say so when the engine's batch limit caps --max-seqs (the rule: ``RuntimeConfig.slots``)."""
    _slots, warning = runtime.slots(m.limits.max_batch)
    if warning:
        err_console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)


def _pool_summary(m, opts) -> str:
    """What the server's block manager will allocate for manifest ``m`` (the server's own ``plan_budget``, for the banner)."""
    import torch

    from trtkv.runtime.llm_engine import plan_budget

    if opts.runtime.kv_memory_gib is None and torch.cuda.is_available():
        slots, _ = opts.runtime.slots(m.limits.max_batch)
        return (f"KV format {m.kv_spec}: {slots} slots; the pool takes what --reserve {opts.runtime.reserve:g} leaves of the GPU "
                "once the engine is loaded (see the trtkv_kv_blocks metric)")
    from trtkv.triton_repo.repository import instance_runtime

    cfg = instance_runtime(opts, "cpu")
    each = "" if opts.instances == 1 else f"{opts.instances} instances, each "
    return f"KV format {m.kv_spec}: {each}{plan_budget(m, cfg, torch.device('cpu'), m.backend).describe()}"


def _plan_torch_serve(m, opts) -> None:
    """The memory plan of serving torch engine ``m`` (trtkv/memory.py): every model instance loads its own weights
    (float32 on CPU when they fit, else bfloat16) and takes its share of the KV budget (``--kv-memory``, else the CPU
    default; on a GPU without --kv-memory the pool is sized from what the weights leave free: not counted)."""
    import torch

    from trtkv.memory import GIB, gib
    from trtkv.runtime.torch_engine import load_plan
    from trtkv.triton_repo.repository import detect_instance_kind

    kind = detect_instance_kind(opts.instance_kind)
    dev = torch.device("cuda" if kind == "gpu" and torch.cuda.is_available() else "cpu")
    kv = opts.runtime.kv_memory(gpu=dev.type == "cuda")
    kv = 0.0 if kv is None else kv
    lp = load_plan(m, dev, kv_bytes=int(kv * GIB))
    p = lp.plan
    need = p.total + (opts.instances - 1) * (p.weights + p.activations)
    if need > p.budget.bytes:
        raise TrtkvError(f"serve does not fit in memory: {opts.instances} instances need {gib(need)} ({p.describe()} for one)",
                         "serve fewer --instances, or a smaller --kv-memory, or on a machine or cgroup with more memory")
    if lp.note:
        err_console.print(f"note: {lp.note}", highlight=False)


def register(app: typer.Typer, handle_errors) -> None:
    @app.command("triton-repo")
    @handle_errors
    @with_repo_options
    def triton_repo(
        engine_dir: Annotated[Path, typer.Argument(help="engine directory from `trtkv build-engine`")],
        out: Annotated[Path, typer.Option("--out", "-o", help="model repository to write")] = Path("trtkv-out/triton_repo"),
        force: Annotated[bool, typer.Option(help="rewrite even if the repository is up to date")] = False,
        k8s: Annotated[Optional[Path], typer.Option("--k8s", help="also write Kubernetes manifests (Deployment, Service, HPA) for replicas of this repository here")] = None,
        k8s_name: Annotated[str, typer.Option("--k8s-name", help="name of the Deployment / Service / HPA")] = "trtkv",
        image: Annotated[Optional[str], typer.Option(help="container image with tritonserver + trtkv (default: trtkv-tritonserver:<version>, see the written Dockerfile)")] = None,
        repo_url: Annotated[Optional[str], typer.Option("--repo-url", help="where the replicas read the repository: s3:// gs:// as:// URL, or a path in the mounted volume")] = None,
        replicas: Annotated[int, typer.Option(help="replicas at start (the autoscaler's minimum)")] = 1,
        max_replicas: Annotated[int, typer.Option("--max-replicas", help="the autoscaler's maximum")] = 4,
        gpus: Annotated[int, typer.Option(help="GPUs per replica (0: CPU)")] = 1,
        **repo_opts,
    ) -> None:
        """Write a Triton model repository (TensorRT-LLM's `ensemble` interface) serving ENGINE_DIR."""
        from trtkv.manifest import load_manifest
        from trtkv.triton_repo.k8s import K8sOptions, write_k8s
        from trtkv.triton_repo.repository import write_repository

        manifest = load_manifest(engine_dir)
        kube = None
        if k8s is not None:
            kube = K8sOptions(name=k8s_name, replicas=replicas, max_replicas=max_replicas, gpus=gpus,
                              **{k: v for k, v in (("image", image), ("repository", repo_url)) if v is not None})
            kube.check()  # before anything is written
            repo_opts["copy_engine"] = True  # replicas read the repository elsewhere: the engine travels inside it
            repo_opts["instance_kind"] = "gpu" if gpus else "cpu"  # what the replicas have, not this machine
        opts = _repo_options(**repo_opts)
        _warn_batch(manifest, opts.runtime)
        path = write_repository(engine_dir, out, opts, force=force)
        console.print(f"model repository written to [bold]{path}[/] (model: ensemble)")
        if kube is not None:
            files = write_k8s(k8s, kube)
            where = kube.repository if kube.from_object_store else f"the volume claim {kube.repository_claim} (mounted at {kube.repository})"
            console.print(f"Kubernetes manifests written to [bold]{k8s}[/] ({', '.join(f.name for f in files)})")
            console.print(f"next: copy {path} to {where}; build and push {kube.image} (Dockerfile); kubectl apply -f {k8s}", highlight=False)

    @app.command()
    @handle_errors
    @with_repo_options
    def serve(
        engine_dir: Annotated[Path, typer.Argument(help="engine directory from `trtkv build-engine`")],
        repo: Annotated[Optional[Path], typer.Option("--repo", help="model repository to write or reuse (default: trtkv-out/triton_repo)")] = None,
        host: Annotated[str, typer.Option(help="address to bind; 0.0.0.0 exposes the server to the network")] = "127.0.0.1",
        http_port: Annotated[int, typer.Option("--http-port")] = 8000,
        grpc_port: Annotated[int, typer.Option("--grpc-port")] = 8001,
        metrics_port: Annotated[int, typer.Option("--metrics-port")] = 8002,
        log_file: Annotated[Optional[Path], typer.Option(help="tritonserver log (default: REPO/tritonserver.log)")] = None,
        timeout: Annotated[float, typer.Option(help="seconds to wait for the server to become ready")] = 300.0,
        openai_port: Annotated[Optional[int], typer.Option(
            "--openai-port", help="also serve OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models on this port (same model, same engine)")] = None,
        served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="the model name OpenAI clients send (default: the engine's model name)")] = None,
        grace: Annotated[float, typer.Option("--grace", help="on Ctrl-C / SIGTERM: seconds requests in flight get to finish before they are failed")] = 10.0,
        restarts: Annotated[int, typer.Option("--restarts", help="restart the server this many times when the model process dies, then exit 3")] = 3,
        **repo_opts,
    ) -> None:
        """Serve ENGINE_DIR with Triton Inference Server (TensorRT-LLM's interface; --openai-port adds the OpenAI API) until Ctrl-C / SIGTERM.

        Exit codes: 0 stopped and drained; 3 the model process died more than --restarts times (or the
        server exited); 4 stopped, but requests in flight were failed after --grace or the server had to be killed."""
        from trtkv.manifest import load_manifest
        from trtkv.triton_repo.repository import write_repository
        from trtkv.triton_repo.server import DRAIN_FILE_ENV, DRAIN_GRACE_ENV, TritonServer, find_tritonserver

        manifest = load_manifest(engine_dir)
        binary = find_tritonserver()
        opts = _repo_options(**repo_opts)
        _warn_batch(manifest, opts.runtime)
        if manifest.backend == "torch" and opts.runtime.backend in ("auto", "torch"):
            _plan_torch_serve(manifest, opts)  # the weights + KV of every instance, before the server reads any
        summary = _pool_summary(manifest, opts)
        path = write_repository(engine_dir, repo or Path("trtkv-out/triton_repo"), opts)
        if grace < 0 or restarts < 0:
            raise TrtkvError("--grace and --restarts must be >= 0", "e.g. --grace 10 --restarts 3")
        server = TritonServer(
            path, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, log_file=(log_file or path / "tritonserver.log").resolve(),
            extra_args=[f"--exit-timeout-secs={TRITON_EXIT_TIMEOUT_S}"],
        )  # fmt: skip
        drain_file = path / f"drain-{os.getpid()}"
        drain_file.unlink(missing_ok=True)
        Path(f"{drain_file}.done").unlink(missing_ok=True)
        server.extra_env = {DRAIN_GRACE_ENV: repr(float(grace)), DRAIN_FILE_ENV: str(drain_file)}
        stop = {"sig": None}
        openai_server = None

        def on_signal(signum, _frame):
            stop["sig"] = signum

        if host not in ("127.0.0.1", "localhost", "::1"):
            err_console.print(
                f"[bold yellow]warning:[/] --host {host} exposes the server (inference, metrics, no authentication) to the network",
                highlight=False,
            )
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            err_console.print(f"starting {binary.path} on {path} ...", highlight=False)
            t0 = time.monotonic()
            server.start(timeout)
            openai_line = None
            if openai_port is not None:  # listening before the ready line: "ready" means every front is up
                from trtkv.triton_repo.openai_api import load_served, start_openai_server

                served = load_served(engine_dir, manifest, server.http_url, served_model_name)
                openai_server = start_openai_server(served, host, openai_port)
                openai_line = (f"  OpenAI   http://{server.client_host}:{openai_port}/v1  (model {served.name!r}: completions, chat/completions, "
                               "models; /health)")
            console.print(f"[bold green]ready[/] in {time.monotonic() - t0:.1f} s — {summary}", highlight=False)
            console.print(f"  HTTP     {server.http_url}  (generate: /v2/models/ensemble/generate, generate_stream)", highlight=False)
            console.print(f"  gRPC     {server.client_host}:{grpc_port}", highlight=False)
            if server.client_host != host:
                console.print(f"  bound to {host} (all interfaces): reachable from other hosts at this machine's addresses, same ports", highlight=False)
            console.print(f"  metrics  {server.metrics_url}  (trtkv_kv_blocks, trtkv_sequences, nv_inference_*)", highlight=False)
            console.print(f"  log      {server.log_file}", highlight=False)
            console.print(
                f"  try: curl -s -X POST {server.http_url}/v2/models/ensemble/generate "
                "-d '{\"text_input\": \"def fibonacci(n):\", \"max_tokens\": 32}'",
                highlight=False,
                soft_wrap=True,
            )
            if openai_line is not None:
                console.print(openai_line, highlight=False)
            console.print("  Ctrl-C stops the server", highlight=False)
            while stop["sig"] is None:
                if server.dead_model_pids():
                    restarts = _restart_dead_model(server, restarts, timeout)
                    continue
                if server.process is None or server.process.poll() is not None:
                    from trtkv.triton_repo.server import tail

                    rc = server.process.returncode if server.process else None
                    err_console.print(f"[bold red]error:[/] tritonserver exited unexpectedly (code {rc}): {tail(server.log_file)}", highlight=False, soft_wrap=True)
                    raise typer.Exit(1)
                time.sleep(0.2)
            err_console.print(f"stopping: no new requests; requests in flight get {grace:g} s ...", highlight=False)
            outcome = _drain(server, drain_file, grace)
        finally:
            if openai_server is not None:  # its streams end first (their last events come from the drained model)
                from trtkv.triton_repo.openai_api import stop_openai_server

                stop_openai_server(openai_server, EXIT_MARGIN_S)
            rc = server.stop(EXIT_MARGIN_S * 3)
            for s, h in old.items():
                signal.signal(s, h)
        code, how = _shutdown_outcome(outcome, rc)
        console.print(f"stopped (tritonserver exit code {rc}): {how}", highlight=False)
        if code:
            raise typer.Exit(code)

    @app.command()
    @handle_errors
    @with_options(runtime_options(GENERATE_OPTIONS, GENERATE_CONFIG))
    def generate(
        prompt: Annotated[str, typer.Argument(help="the prompt")],
        engine: Annotated[Optional[Path], typer.Option("--engine", help="run the engine directory offline (no server)")] = None,
        url: Annotated[Optional[str], typer.Option("--url", help="send to a running server instead, e.g. http://127.0.0.1:8000")] = None,
        max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 64,
        temperature: Annotated[float, typer.Option(help="0: greedy")] = 0.0,
        top_k: Annotated[int, typer.Option(help="0: off")] = 0,
        top_p: Annotated[float, typer.Option(help="1.0: off")] = 1.0,
        seed: Annotated[Optional[int], typer.Option(help="reproducible sampling")] = None,
        stop: Annotated[Optional[list[str]], typer.Option("--stop", help="stop word (repeatable)")] = None,
        stream: Annotated[bool, typer.Option("--stream/--no-stream", help="print tokens as they come")] = True,
        wait: Annotated[float, typer.Option(help="with --url: wait up to this many seconds for the server to be ready")] = 0.0,
        **runtime_opts,
    ) -> None:
        """Generate text for PROMPT, offline with --engine or from a running server with --url."""
        if (engine is None) == (url is None):
            raise TrtkvError("generate needs exactly one of --engine DIR and --url URL", "pass --engine trtkv-out/engine or --url http://127.0.0.1:8000")
        if url is not None:
            if wait > 0:
                from trtkv.triton_repo.client import wait_ready

                wait_ready(url, wait)
            _generate_remote(url, prompt, max_tokens, temperature, top_k, top_p, seed, stop or [], stream)
        else:
            _generate_offline(engine, prompt, max_tokens, temperature, top_k, top_p, seed, stop or [], stream, GENERATE_CONFIG.replace(**runtime_opts))


EXIT_MARGIN_S = 5  # serve waits this long past the grace for the drain's answer, and 3x this for tritonserver to exit
# tritonserver's own exit timeout: serve's drain (the drain file) gives requests in flight their grace period, so once the
# model has answered tritonserver only flushes the last responses; its HTTP service would otherwise wait the whole timeout
# for every idle keep-alive connection a client left open ("Found 1 HTTP service connections")
TRITON_EXIT_TIMEOUT_S = 3


def _restart_dead_model(server, restarts: int, timeout: float) -> int:
    """The model process died: Triton would keep answering ready and leave its streams hanging. Kill the
    server (readiness fails, in-flight connections are closed), then start it again or exit 3. The restarts left."""
    import typer

    dead = server.dead_model_pids()
    err_console.print(
        f"[bold red]error:[/] the model process (python backend stub, pid {', '.join(map(str, dead))}) died; "
        "stopping tritonserver (its requests in flight are cut)",
        highlight=False,
    )
    server.stop(0)
    if restarts <= 0:
        err_console.print("[bold red]error:[/] no restarts left (--restarts); exiting with code 3", highlight=False)
        raise typer.Exit(3)
    err_console.print(f"restarting tritonserver ({restarts - 1} restarts left) ...", highlight=False)
    t0 = time.monotonic()
    server.start(timeout)
    console.print(f"[bold green]ready[/] again in {time.monotonic() - t0:.1f} s after a restart", highlight=False)
    return restarts - 1


def _drain(server, drain_file: Path, grace: float) -> str | None:
    """Ask the model to drain (it polls ``drain_file``) and wait for its answer: "drained", "failed N", or None."""
    done = Path(f"{drain_file}.done")
    partial = Path(f"{drain_file}.partial")  # written whole, then renamed: the model never reads a half-written file
    partial.write_text(repr(float(grace)))
    os.replace(partial, drain_file)
    deadline = time.monotonic() + grace + EXIT_MARGIN_S
    while time.monotonic() < deadline and server.process is not None and server.process.poll() is None and not server.dead_model_pids():
        if done.is_file():
            outcome = done.read_text().strip()
            done.unlink(missing_ok=True)
            drain_file.unlink(missing_ok=True)
            return outcome
        time.sleep(0.05)
    drain_file.unlink(missing_ok=True)
    return None


def _shutdown_outcome(outcome: str | None, rc) -> tuple[int, str]:
    """Exit code and sentence for a stop: 0 when every request in flight finished (the model said so: a tritonserver
    that then had to be killed cut nothing), 4 when some were failed or the end is unknown."""
    if outcome == "drained" and rc == 0:
        return 0, "drained, every request in flight finished"
    if outcome == "drained":  # Triton's HTTP service spends its exit timeout waiting for idle keep-alive connections
        how = f"exited with code {rc} at the end of its exit timeout" if rc is not None and rc > 0 else "was stopped after its exit timeout"
        return 0, f"drained, every request in flight finished (tritonserver {how}, with idle client connections still open)"
    if outcome and outcome.startswith("failed"):
        return 4, f"{outcome.split()[-1]} requests in flight did not finish within --grace and were failed with an error"
    if rc is None or rc < 0:
        return 4, "tritonserver did not stop in time and was killed; requests in flight were cut"
    return 4, "the model did not confirm the drain; requests in flight may have been cut"


def _generate_offline(engine_dir, prompt, max_tokens, temperature, top_k, top_p, seed, stop, stream, config: RuntimeConfig) -> None:
    from trtkv.runtime.llm_engine import LLMEngine
    from trtkv.runtime.sequence import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_words=stop).validate()
    t0 = time.monotonic()
    llm = LLMEngine.from_engine_dir(engine_dir, config)
    t1 = time.monotonic()
    first = {}

    def on_output(o):
        first.setdefault("t", time.monotonic())
        if stream and o.new_text:
            sys.stdout.write(o.new_text)
            sys.stdout.flush()

    if stream:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    (out,) = llm.generate([prompt], params, on_output=on_output)
    t2 = time.monotonic()
    sys.stdout.write("\n" if stream else prompt + out.text + "\n")
    sys.stdout.flush()
    n = len(out.new_token_ids)
    ttft = first.get("t", t2) - t1
    err_console.print(
        f"[dim]{out.num_prompt_tokens} prompt + {n} new tokens ({out.finish_reason}); load {t1 - t0:.1f} s, first token {ttft:.2f} s, "
        f"{n / max(t2 - t1, 1e-9):.1f} tok/s; KV {llm.manifest.kv_spec}; {llm.describe_engine()}[/]",
        highlight=False,
    )


def _generate_remote(url, prompt, max_tokens, temperature, top_k, top_p, seed, stop, stream) -> None:
    from trtkv.triton_repo.client import generate, stream_generate

    params = {"temperature": temperature if temperature > 0 else None, "top_k": top_k or None, "top_p": top_p if top_p < 1 else None, "seed": seed}
    if stop:
        params["stop_words"] = stop
    t0 = time.monotonic()
    if stream:
        sys.stdout.write(prompt)
        n = 0
        for piece in stream_generate(url, prompt, max_tokens, **params):
            sys.stdout.write(piece.text)
            sys.stdout.flush()
            n += 1
        sys.stdout.write("\n")
        err_console.print(f"[dim]{n} responses in {time.monotonic() - t0:.2f} s from {url}[/]", highlight=False)
    else:
        data = generate(url, prompt, max_tokens, **params)
        sys.stdout.write(data.get("text_output", "") + "\n")

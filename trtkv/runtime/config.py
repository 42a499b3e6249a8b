"""``RuntimeConfig``: every serving setting, its default, its range and its description, in one place.

Everything asks it: ``LLMEngine`` (the budget rule ``kv_memory``), the Triton repository (which writes it
once, as JSON, and whose python model validates it on load), and the CLI, whose ``serve`` / ``triton-repo`` /
``generate`` options and help are generated from the fields (``trtkv.cli_options.field_option``). Kept free of
torch so that the CLI and the repository writer can read it without loading the runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trtkv.engine_backends import ATTENTIONS, RUNTIME_BACKENDS
from trtkv.errors import TrtkvError
from trtkv.gpu import DEFAULT_RESERVE

RuntimeBackend = Literal[RUNTIME_BACKENDS]  # Literal of a tuple: its members
AttentionName = Literal[ATTENTIONS]


def _flag(flag: str, unset: str | None = None) -> dict:
    """A field's CLI flag (typer's declaration) and, for a ``None`` default, what unset means (shown as the default)."""
    return {"flag": flag, **({"unset": unset} if unset else {})}


class RuntimeConfig(BaseModel):
    """The runtime's settings. Strict (``"8"`` is not 8, ``"1"`` is not True) and closed (an unknown key is an error):
    the repository's ``runtime_config.json`` may be edited by hand, and a typo must not be ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    CPU_KV_MEMORY_GIB: ClassVar[float] = 1.0  # the KV budget on CPU when kv_memory_gib is unset
    kv_memory_gib: float | None = Field(
        None, gt=0, description="KV cache budget in GiB (pool blocks + open blocks of every slot)",
        json_schema_extra=_flag("--kv-memory", f"{CPU_KV_MEMORY_GIB:g} GiB on CPU; on a GPU what --reserve leaves"))
    reserve: float = Field(
        DEFAULT_RESERVE, ge=0, lt=1, description="on a GPU without --kv-memory: the fraction of the GPU's memory kept for "
        "activations and workspace; the KV cache takes the rest of what the loaded engine leaves free (the rule of `trtkv plan --reserve`)",
        json_schema_extra=_flag("--reserve"))
    max_seqs: int | None = Field(
        None, ge=1, description="sequence slots = most sequences running at once (each costs one fp16 open block per layer "
        "and K/V); at most the engine's --max-batch, which caps a larger value with a warning",
        json_schema_extra=_flag("--max-seqs", "the engine's --max-batch"))
    max_batched_tokens: int = Field(
        512, ge=1, description="tokens per scheduler step (prefill chunks + decodes)", json_schema_extra=_flag("--max-batched-tokens"))
    backend: RuntimeBackend = Field(
        "auto", description=f"engine backend: {' | '.join(RUNTIME_BACKENDS)} (auto: the manifest's; TensorRT when it has a plan and a GPU is present)",
        json_schema_extra=_flag("--backend"))
    attention: AttentionName = Field(
        "auto", description=f"the torch engine's attention: {' | '.join(ATTENTIONS)} (auto: the Triton kernels on CUDA, trtkv's C "
        "kernels on CPU, where they run the engine's format, else the torch ops; the server's start line says which)",
        json_schema_extra=_flag("--attention"))
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="the device of the model instance (the repository writes its instance kind; the engine backend places itself)")
    enable_prefix_caching: bool = Field(
        True, description="share the sealed KV blocks of common prompt prefixes between requests (a hit gives the same "
        "outputs as recomputing them)", json_schema_extra=_flag("--prefix-cache/--no-prefix-cache"))
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads of each step of a torch engine on CPU",
        json_schema_extra=_flag("--cpu-threads", "every core the process may use"))
    deterministic: bool = Field(
        False, description="batch-invariant mode: greedy outputs and log-probabilities independent of batching, chunking, preemption "
        "and prefix caching (each sequence's chunks run as engine calls of their own, prefill one whole block per step; "
        "slower than the default mode: docs/serving.md)", json_schema_extra=_flag("--deterministic/--no-deterministic"))
    free_window_blocks: bool = Field(
        True, description="sliding-window layers free the sealed blocks their window has passed (torch engine; a model "
        "with such layers then serves without prefix caching)", json_schema_extra=_flag("--free-window-blocks/--keep-window-blocks"))

    def __init__(self, **values):
        """Validate, and turn a bad value into one ``TrtkvError`` line that names the field (and its CLI flag)."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise RuntimeConfigError(exc, "runtime config", "see `trtkv serve --help` for each setting and its range") from None

    @classmethod
    def load(cls, path: Path | str) -> "RuntimeConfig":
        """The config in the JSON file ``path``; a missing, malformed or invalid file is one line naming it and the field."""
        path = Path(path)
        fix = "correct the file, or rewrite the repository (`trtkv triton-repo ENGINE --force` or `trtkv serve`)"
        try:
            text = path.read_text()
        except OSError as exc:
            raise TrtkvError(f"cannot read the runtime config {path}: {exc.strerror}", fix) from None
        try:
            return cls.model_validate_json(text)  # pydantic runs __init__ (a custom one) on the parsed fields
        except RuntimeConfigError as exc:
            raise TrtkvError(f"{path}: {exc.detail}", fix) from None
        except ValidationError as exc:  # not JSON, or not an object
            raise RuntimeConfigError(exc, str(path), fix) from None

    def dump_json(self) -> str:
        """Every field, defaults included (the file then says what the server runs with, whatever a later default)."""
        return self.model_dump_json(indent=2) + "\n"

    def replace(self, **changes) -> "RuntimeConfig":
        """A validated copy with ``changes`` (``model_copy(update=...)`` would not validate them)."""
        return RuntimeConfig(**{**self.model_dump(), **changes})

    def step_threads(self, cores: int) -> int:
        """torch threads for a CPU step on a machine with ``cores`` usable cores."""
        return self.cpu_threads if self.cpu_threads is not None else cores

    def kv_memory(self, *, gpu: bool) -> float | None:
        """The KV budget in GiB: kv_memory_gib, else the CPU default off a GPU; None on a GPU without
        kv_memory_gib (the pool takes what ``reserve`` leaves of the device once the engine is loaded)."""
        if self.kv_memory_gib is not None:
            return self.kv_memory_gib
        return None if gpu else self.CPU_KV_MEMORY_GIB

    def slots(self, max_batch: int) -> tuple[int, str | None]:
        """The sequence slots served by an engine built for ``max_batch`` sequences, and a warning when the engine caps
        ``max_seqs``. The one batch rule: the engine's --max-batch is the limit, --max-seqs (default: it) may only lower it."""
        if self.max_seqs is None or self.max_seqs <= max_batch:
            return (max_batch if self.max_seqs is None else self.max_seqs), None
        return max_batch, (f"--max-seqs {self.max_seqs} is above the engine's batch limit (build-engine --max-batch {max_batch}): "
                           f"serving {max_batch} sequences at once; rebuild the engine with --max-batch {self.max_seqs} for more")


class RuntimeConfigError(TrtkvError):
    """Pydantic's first error as one line, ``where: field (--flag) = value: message``; ``detail`` is all but ``where``."""

    def __init__(self, exc: ValidationError, where: str, fix: str):
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        info = RuntimeConfig.model_fields.get(loc)
        flag = (info.json_schema_extra or {}).get("flag") if info is not None else None
        field = f"{loc} ({flag.split('/')[0]})" if flag else loc
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        self.field = loc or None
        self.detail = (f"{field} = {err['input']!r}: " if loc else "") + f"{err['msg']}{more}".replace("\n", " ")
        super().__init__(f"{where}: {self.detail}", fix)

"""The pipeline on a model of a size people deploy, on the memory a laptop leaves free.

Writes a random-weight checkpoint of a real model's shape (bf16 safetensors shards with an index, the builtin
tokenizer's vocabulary and tokenizer files), then runs each command as its own process inside a cgroup v1 memory
limit (the kernel kills only that process when it is over), and records wall time, the time of the first output
line, peak RSS, the cgroup's peak usage and whether the kernel killed it:

    plan (hashes the checkpoint once), calibrate (default options, 2 x 256 tokens), eval (2 x 256 tokens),
    build-engine --backend torch (int4), export --to vllm, generate 8 tokens (needs the weights resident: run in a
    larger limit, bf16 on this CPU is slow), and the 70B shape on paper through `trtkv plan`.

    python bench/scale.py --shape llama-3.1-8b --limit-gib 8 --generate-limit-gib 20

Results: bench/results/scale-<shape>.{json,md}, with the machine, its load and every command. Needs root
(the cgroup v1 memory controller at /sys/fs/cgroup/memory); without it, commands run unconfined and say so.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRTKV = str(Path(sys.executable).parent / "trtkv")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")

# Real models' shapes (their config.json values); the vocabulary is the builtin tokenizer's, so text tokenizes.
SHAPES = {
    "llama-3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192},
                         tie_word_embeddings=False),
    "llama-3.1-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                          intermediate_size=28672, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                          tie_word_embeddings=False),
}


def _tensor_shapes(cfg: dict, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def write_checkpoint(shape: str, out: Path, shards: int = 4, seed: int = 0) -> Path:
    """A random-weight bf16 checkpoint of ``shape`` in ``shards`` safetensors files with an index (kept when present)."""
    from safetensors.torch import save_file

    from trtkv.models import load_tokenizer

    if (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file():
        return out
    tok = load_tokenizer("smollm2-135m")
    vocab = len(tok)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_act": "silu",
           "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "torch_dtype": "bfloat16",
           "attention_bias": False, "mlp_bias": False, **SHAPES[shape]}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = _tensor_shapes(cfg, vocab)
    total = sum(2 * torch.Size(s).numel() for _, s in tensors)
    per_shard = -(-total // shards)
    gen = torch.Generator().manual_seed(seed)
    weight_map, shard, shard_bytes, index = {}, {}, 0, 1

    def flush():
        nonlocal shard, shard_bytes, index
        name = f"model-{index:05d}-of-{shards:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        print(f"  wrote {name} ({shard_bytes / 2**30:.2f} GiB)", file=sys.stderr, flush=True)
        shard, shard_bytes, index = {}, 0, index + 1

    for name, s in tensors:
        if name.endswith("norm.weight"):
            t = torch.ones(s, dtype=torch.bfloat16)
        else:  # std 0.02 like the models' initializer; o / down projections scaled for the residual stream
            std = 0.02 / (2 * cfg["num_hidden_layers"]) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            t = (torch.randn(s, generator=gen) * std).to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= per_shard and index < shards:
            flush()
    if shard:
        flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


class Confined:
    """A cgroup v1 memory group with a limit; a child started with ``preexec`` runs inside it."""

    def __init__(self, name: str, limit_bytes: int):
        self.path = CGROUP_V1 / name
        self.enabled = CGROUP_V1.is_dir() and os.access(CGROUP_V1, os.W_OK)
        if self.enabled:
            if self.path.exists():
                self.path.rmdir()
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            # no swap: what does not fit is the OOM killer's, as on a machine without swap
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))

    def preexec(self) -> None:
        if self.enabled:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        return int((self.path / "memory.max_usage_in_bytes").read_text()) if self.enabled else None

    def oom_kills(self) -> int:
        if not self.enabled:
            return 0
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        if self.enabled:
            try:
                self.path.rmdir()
            except OSError:
                pass


def run_step(name: str, argv: list[str], limit_gib: float, log_dir: Path, timeout: float) -> dict:
    """Run ``argv`` confined to ``limit_gib``; wall time, first line, peak RSS, cgroup peak, killed or not."""
    group = Confined(f"trtkv-scale-{os.getpid()}-{name}", int(limit_gib * 2**30))
    load0 = os.getloadavg()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    log = log_dir / f"{name}.log"
    t0 = time.perf_counter()
    first: list[float] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=group.preexec, env=env, cwd=ROOT)
    lines: list[str] = []

    def read():
        for raw in iter(proc.stdout.readline, b""):
            if not first:
                first.append(time.perf_counter() - t0)
            text = raw.decode(errors="replace").rstrip()
            lines.append(text)
            print(f"    [{name} {time.perf_counter() - t0:7.1f}s] {text}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # rusage of this child alone
        rc = os.waitstatus_to_exitcode(status)
        proc.returncode = rc
    except KeyboardInterrupt:
        proc.kill()
        raise
    reader.join(timeout=10)
    wall = time.perf_counter() - t0
    log.write_text("\n".join(lines) + "\n")
    out = dict(step=name, command=" ".join(argv), limit_gib=limit_gib, confined=group.enabled, exit_code=rc,
               killed_for_memory=group.oom_kills() > 0 or rc == -9, wall_s=round(wall, 1),
               first_line_s=round(first[0], 2) if first else None, peak_rss_gib=round(usage.ru_maxrss * 1024 / 2**30, 2),
               cgroup_peak_gib=None if group.peak() is None else round(group.peak() / 2**30, 2),
               load_avg_at_start=[round(x, 2) for x in load0], last_line=lines[-1][:300] if lines else "", log=str(log.relative_to(ROOT)) if log.is_relative_to(ROOT) else str(log))
    group.close()
    del timeout
    return out


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "?")
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")), 0)
    return dict(cpu=cpu, cores=os.cpu_count(), memory_gib=round(mem / 2**30, 1), python=platform.python_version(),
                torch=torch.__version__, load_avg=os.getloadavg(), gpu="none")


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Scale: {result['shape']} ({result['params_b']:.2f} B parameters, {result['checkpoint_gib']:.2f} GiB bf16 in "
             f"{result['shards']} shards), {result['date']}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU; load average at start "
             f"{', '.join(f'{x:.2f}' for x in result['load_at_start'])}; torch {m['torch']}.", "",
             f"Command: `{result['command']}`", "",
             "Each step is its own process in a cgroup v1 memory limit (the kernel kills only it when it is over).", "",
             "| step | limit GiB | exit | killed | wall s | first line s | peak RSS GiB | cgroup peak GiB | load at start | last line |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for s in result["steps"]:
        last = s["last_line"].replace("|", "\\|")[:120]
        lines.append(f"| {s['step']} | {s['limit_gib']:g} | {s['exit_code']} | {'yes' if s['killed_for_memory'] else 'no'} | "
                     f"{s['wall_s']} | {s['first_line_s']} | {s['peak_rss_gib']} | {s['cgroup_peak_gib']} | "
                     f"{s.get('load_avg_at_start', ['?'])[0]} | {last} |")
    lines += ["", "Commands:", ""] + [f"- {s['step']}: `{s['command']}`" for s in result["steps"]]
    return "\n".join(lines) + "\n"


def shape_info(shape: str, vocab: int = 128256):
    """A ``ModelInfo`` of a named shape without a checkpoint (the memory plan needs only the geometry)."""
    from trtkv.models import ModelInfo

    c = SHAPES[shape]
    h, L, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    hd = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    n = L * per_layer + vocab * h * (1 if c["tie_word_embeddings"] else 2) + h
    return ModelInfo(name=shape, sha256="-", architecture="LlamaForCausalLM", num_layers=L, num_heads=c["num_attention_heads"],
                     num_kv_heads=c["num_key_value_heads"], head_dim=hd, hidden_size=h, vocab_size=vocab, num_params=n)


def fits_table() -> str:
    """What fits where: each command's memory plan (trtkv.memory, the numbers the commands refuse by) for the real
    vocabularies of Llama 3.1, at the commands' defaults (calibrate 64 x 512, eval 64 x 512 x 3 formats)."""
    from trtkv.memory import GIB, activation_bytes, plan_memory

    rows = ["| shape | parameters | command | float32 resident | bfloat16 resident | float32 streamed |", "|---|---:|---|---:|---:|---:|"]
    cpu = torch.device("cpu")
    for shape in ("llama-3.1-8b", "llama-3.1-70b"):
        info = shape_info(shape)
        for cmd, acts in (("calibrate", activation_bytes(info, batch=4, seq_len=512, dtype=torch.float32, logits=False)
                           + 64 * 512 * info.hidden_size * 4),
                          ("eval", activation_bytes(info, batch=4, seq_len=512, dtype=torch.float32, logits=True)
                           + 3 * 64 * 512 * info.hidden_size * 4 + 3 * 4 * 512 * info.vocab_size * 4)):
            cells = []
            for dt_, streamed in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
                p = plan_memory(info, cpu, dt_, streamed=streamed, activations=acts, budget=None)
                cells.append(f"{p.total / GIB:.1f} GiB")
            rows.append(f"| {shape} | {info.num_params / 1e9:.2f} B | {cmd} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=[k for k in SHAPES if k != "llama-3.1-70b"])
    ap.add_argument("--dir", type=Path, default=Path("~/.cache/trtkv/scale").expanduser(), help="where checkpoint and outputs go")
    ap.add_argument("--limit-gib", type=float, default=8.0)
    ap.add_argument("--generate-limit-gib", type=float, default=20.0)
    ap.add_argument("--steps", default="plan,calibrate,eval,build-engine,export,generate,plan-70b")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--fits", action="store_true", help="print what fits where (the memory plans of the shapes) and exit")
    args = ap.parse_args()
    if args.fits:
        print(fits_table())
        return

    load0 = os.getloadavg()
    ckpt = write_checkpoint(args.shape, args.dir / args.shape)
    work = args.dir / f"{args.shape}-out"
    work.mkdir(parents=True, exist_ok=True)
    logs = args.results / f"scale-{args.shape}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    total = index["metadata"]["total_size"]
    m, c = str(ckpt), str(work / "calibration")
    s70 = SHAPES["llama-3.1-70b"]
    steps = {
        "plan": ([TRTKV, "plan", "--model", m, "--gpu", "H100-80GB", "--context", "8192"], args.limit_gib),
        "calibrate": ([TRTKV, "calibrate", "--model", m, "--dataset", "builtin:pydoc", "--samples", "2", "--seq-len", "256", "--out", c], args.limit_gib),
        "eval": ([TRTKV, "eval", "--model", m, "--calibration", c, "--windows", "2", "--seq-len", "256", "--json", str(work / "eval.json")], args.limit_gib),
        "build-engine": ([TRTKV, "build-engine", "--backend", "torch", "--model", m, "--calibration", c, "--kv", "int4",
                          "--out", str(work / "engine-int4"), "--force"], args.limit_gib),
        "export": ([TRTKV, "export", "--model", m, "--calibration", c, "--to", "vllm", "--out", str(work / "vllm"), "--force"], args.limit_gib),
        "generate": ([TRTKV, "generate", "--engine", str(work / "engine-int4"), "def fibonacci(n):", "-n", "8", "--kv-memory", "0.25"],
                     args.generate_limit_gib),
        # 70B on paper: one tensor-parallel rank of two (half the KV heads, half the 131.4 GiB of bf16 weights) per H200
        "plan-70b": ([TRTKV, "plan", "--layers", str(s70["num_hidden_layers"]), "--kv-heads", str(s70["num_key_value_heads"] // 2),
                      "--head-dim", str(s70["hidden_size"] // s70["num_attention_heads"]), "--weights-gib", "65.7",
                      "--gpu", "H200-141GB", "--context", "32768"], args.limit_gib),
    }
    wanted = [s.strip() for s in args.steps.split(",") if s.strip()]
    today = dt.date.today().isoformat()
    json_path, md_path = (args.results / f"scale-{args.shape}{ext}" for ext in (".json", ".md"))

    def save(done: list[dict]) -> dict:
        """Write the day's results after every step; steps run before (another invocation the same day) are kept."""
        ran = {r["step"] for r in done}
        kept = []
        if json_path.is_file():
            kept = [s for s in json.loads(json_path.read_text())["steps"] if s["step"] not in ran]
        merged = sorted(kept + done, key=lambda r: list(steps).index(r["step"]))
        result = dict(shape=args.shape, date=today, params_b=total / 2 / 1e9, checkpoint_gib=total / 2**30,
                      shards=len(set(index["weight_map"].values())), machine=machine(), load_at_start=load0,
                      command=" ".join([Path(sys.executable).name, *sys.argv]), steps=merged,
                      maxrss_self_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, 2))
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        md_path.write_text(render(result))
        return result

    results: list[dict] = []
    for name in wanted:
        argv, limit = steps[name]
        print(f"== {name} (limit {limit:g} GiB)", file=sys.stderr, flush=True)
        results.append(run_step(name, argv, limit, logs, args.timeout))
        print(f"   -> {json.dumps(results[-1])}", file=sys.stderr, flush=True)
        result = save(results)
    print(render(result))


if __name__ == "__main__":
    main()

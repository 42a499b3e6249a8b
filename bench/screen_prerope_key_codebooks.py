"""Screen (issue 27, round 6): keys stored before RoPE *and* through a codebook, measured before building it.

The product refuses ``prerope`` with ``nuq`` (``trtkv.formats``: key codebooks are fitted to keys after RoPE). This
screen lifts that check in this process only and fits the key codebooks in the pre-RoPE frame -- the calibration
windows un-rotated at their positions 0 .. S-1 with the model's RoPE table, the keys' query weights averaged over each
RoPE pair (``calibration.scales.query_smoothing_factors``' rule) -- then runs ``bench/accuracy.py``'s rows beside the
presets. Result (2026-12-05, docs/accuracy.md round 6): worse than the uniform grid on pydoc at int2 and int3, mixed on
Shakespeare -- not built.

    python bench/screen_prerope_key_codebooks.py --stats-cache FILE pydoc shakespeare
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]


def _formats_without_the_check() -> None:
    import trtkv

    path = ROOT / "trtkv" / "formats.py"
    src = path.read_text()
    check = '''        if self.pre_rope and self.codebook:
            raise ValueError("prerope with nuq: key codebooks are fitted to keys after RoPE; give one")'''
    assert check in src, "trtkv/formats.py changed: update this screen"
    mod = types.ModuleType("trtkv.formats")
    mod.__file__, mod.__package__ = str(path), "trtkv"
    sys.modules["trtkv.formats"] = trtkv.formats = mod
    exec(compile(src.replace(check, "        pass"), str(path), "exec"), mod.__dict__)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("texts", nargs="+", choices=["pydoc", "shakespeare"])
    p.add_argument("--stats-cache", required=True)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "accuracy-issue27-round6"))
    args = p.parse_args(argv)
    _formats_without_the_check()

    import torch

    import trtkv.calibration.codebook as cb
    import trtkv.models as models
    from trtkv.rope import RopeTable, rotate

    rope: dict = {}
    load_model = models.load_model

    def load_and_keep_rope(*a, **k):
        loaded = load_model(*a, **k)
        rope["table"] = RopeTable.of(loaded.model)
        return loaded

    fit_codebooks = cb.fit_codebooks

    def fit_prerope_keys(windows, fmt, params, query_moment, *, per_head=True, weight_keys=True, layers=None):
        fit_codebooks(windows, fmt.model_copy(update={"k": fmt.k.model_copy(update={"codebook": False})}) if fmt.k.pre_rope else fmt,
                      params, query_moment, per_head=per_head, weight_keys=weight_keys, layers=layers)
        if not (fmt.k.pre_rope and fmt.k.codebook):
            return
        for i in layers if layers is not None else range(len(params)):
            tf, tp = fmt.layer(i).k, params[i].k
            w = windows["k"][i].float()  # [W, S, H, D] after RoPE at positions 0 .. S-1
            cos, sin = rope["table"].upto(w.shape[1])
            w = rotate(w, cos[: w.shape[1], None], sin[: w.shape[1], None], inverse=True)
            grid_tf = tf.model_copy(update={"pre_rope": False})
            d = query_moment[i].double().diagonal(dim1=-2, dim2=-1).clamp_min(0)
            half = d.shape[-1] // 2
            d = (d + torch.cat([d[..., half:], d[..., :half]], -1)) / 2  # a pre-RoPE channel meets both of its pair
            weight = cb.key_channel_weights(torch.diag_embed(d), grid_tf, tp.smooth) if weight_keys else None
            tp.codebook = cb.fit_codebook(cb.sealed_blocks(w, fmt), grid_tf, tp, weight, per_head=per_head)

    models.load_model, cb.fit_codebooks = load_and_keep_rope, fit_prerope_keys
    import accuracy

    K2, K3 = accuracy.K2PQ, accuracy.K3PQ
    rows = [
        ("int2-nuq-knuq", f"k={K2}:out64:nuq,v=int2:token:sym:hadamard:nuq,block=128,sink=4", "int2-nuq, the keys' bulk through a pre-RoPE codebook"),
        ("int2-kout128-knuq", f"k={K2}:out128:nuq,v=int2:token:sym:hadamard:nuq,block=128,sink=4", "128 key outliers, the keys' bulk through a codebook"),
        ("int3-nuq-knuq", f"k={K3}:out128:nuq,v=int3:token:sym:hadamard:nuq,block=128,sink=4", "int3-nuq, the keys' bulk through a codebook"),
    ]
    accuracy.ROWS.extend(accuracy.Row(name, spec, note=note) for name, spec, note in rows)
    accuracy.GROUPS["round6"] = ["int3-nuq", "int2-nuq", "int2-b128-kout128-vnuq", *[r[0] for r in rows]]
    for text in args.texts:
        accuracy.main(["--rows", "round6", "--windows", "8", "--generate-prompts", "0", "--eval-dataset", f"builtin:{text}",
                       "--stats-cache", args.stats_cache, "--out", f"{args.out}-{text}-8windows"])


if __name__ == "__main__":
    main()

"""The names of the KV presets, without torch, so that every command's ``--help`` lists them without loading it.

``trtkv.formats.PRESETS`` defines exactly these, in this order (it asserts so). ``budget`` is not a preset but the name
``trtkv calibrate --budget`` saves its per-layer choice under by default.
"""

PRESET_NAMES = ("fp16", "fp8", "int8-static", "int8", "int4", "int3", "int2")
BUDGET_NAME = "budget"
KV_HELP = ("a preset (" + ", ".join(PRESET_NAMES) + f"), the name a calibration saved (--budget: '{BUDGET_NAME}'), "
           "a spec string or a JSON file (docs/kv-formats.md)")

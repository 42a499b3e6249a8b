"""trtkv.calibration stage.

The accuracy budget's defaults live here, torch-free, so that ``trtkv calibrate --help`` shows them without importing the
search (calibration/budget.py says why each is what it is)."""

DEFAULT_BUDGET_FORMATS = ("int4", "int3", "int2")  # what --budget chooses among when --budget-formats is not given
DEFAULT_BUDGET_WINDOWS = 4  # calibration windows the search measures on (and as many others for its check)
# held-out text costs more than the search's calibration windows: over the default candidates, ppl=1% on SmolLM2-135M
# held on both held-out texts (pydoc, Shakespeare) at a margin of 0.6 and went over on Shakespeare at 0.33
# (docs/calibration.md)
DEFAULT_BUDGET_MARGIN = 0.6
DEFAULT_FIT_WINDOWS = 4  # whole calibration windows the statistics keep, which codebooks (nuq) and per-channel bits (allocB) are fitted on

"""trtkv.calibration stage.

The accuracy budget's defaults live here, torch-free, so that ``trtkv calibrate --help`` shows them without importing the
search (calibration/budget.py says why each is what it is)."""

DEFAULT_BUDGET_FORMATS = ("int4", "int3", "int2")  # what --budget chooses among when --budget-formats is not given
DEFAULT_BUDGET_WINDOWS = 4  # calibration windows the search measures on (and as many others for its check)
# held-out text read up to 19 % more KL than the check's calibration windows, and on text unlike them (Shakespeare) Δppl
# reads up to 16 % more than the KL predicts: 1.19 x 1.16 = 1.38, so a third below (docs/calibration.md)
DEFAULT_BUDGET_MARGIN = 0.33
DEFAULT_FIT_WINDOWS = 4  # whole calibration windows the statistics keep, which nuq codebooks and alloc bits are fitted on

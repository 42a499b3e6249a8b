"""trtkv.calibration stage.

The accuracy budget's defaults live here, torch-free, so that ``trtkv calibrate --help`` shows them without importing the
search (calibration/budget.py says why each is what it is)."""

DEFAULT_BUDGET_FORMATS = ("int4", "int3", "int2")  # what --budget chooses among when --budget-formats is not given
DEFAULT_BUDGET_WINDOWS = 4  # calibration windows the search measures on (and as many others for its check)
DEFAULT_BUDGET_MARGIN = 0.25  # held-out text read 10-15 % more KL than the calibration windows

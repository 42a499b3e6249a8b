"""The sections of ``bench/gpu_check.py``: one module each, run in ``SECTIONS`` order by that entry point."""

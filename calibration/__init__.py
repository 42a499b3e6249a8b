"""trtkv.calibration stage."""

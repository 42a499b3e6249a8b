"""trtkv.triton_repo stage."""

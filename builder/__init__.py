"""trtkv.builder stage."""

"""trtkv.plugins stage."""

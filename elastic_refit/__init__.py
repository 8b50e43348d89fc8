"""elastic-refit: move only the shard intersections between live training and inference layouts."""

__version__ = "0.1.0"

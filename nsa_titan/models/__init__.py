"""Models: the NSA transformer and its attention implementations."""

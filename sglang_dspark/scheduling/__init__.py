"""Confidence-scheduled verification: Algorithm 1 and its async and static variants
(``scheduler``), the engine's throughput table SPS(B) (``sps``)."""

"""Lossless verification: rejection sampling (``rejection``), the statistics that test an
output distribution against the target's (``losslessness``), the audit command (``audit``)."""

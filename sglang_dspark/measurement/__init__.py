"""Load-test measurement: per-request samples to stage summaries (``loadmetrics``) and
Pareto frontiers with confidence intervals (``pareto``)."""

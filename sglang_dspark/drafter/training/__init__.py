"""Training drafters against a frozen target: the trainers (``train``: DSpark, ``train_mtp``,
``train_v4``), data, losses, target adapters, the feature store."""

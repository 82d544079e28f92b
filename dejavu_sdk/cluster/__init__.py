"""Placing a pipeline's controller and stage workers on cluster schedulers (`dejavu_sdk.cluster.ray`)."""

"""Prefect flows that chain the stage tasks into the training loop (entrypoints for ``prefect deploy``)."""

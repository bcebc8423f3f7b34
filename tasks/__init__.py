"""Prefect tasks that own the side effects: Ray fan-out, Parquet shards, the DeepSpeed launch, MLflow."""

# The Prefect artifact key of the results table. Here, so that `infra/stack.py results` reads it
# without importing the evaluation stack (torch, Ray: seconds).
RESULTS_ARTIFACT = "jacobi-forcing-results"

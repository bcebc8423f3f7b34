"""Prefect tasks that own the side effects: Ray fan-out, Parquet shards, the DeepSpeed launch, MLflow."""

# The Prefect artifact keys of the results table and of the gate's decision. Here, so that `infra/stack.py results`
# reads them without importing the evaluation stack (torch, Ray: seconds).
RESULTS_ARTIFACT = "jacobi-forcing-results"
GATE_ARTIFACT = "jacobi-forcing-gate"

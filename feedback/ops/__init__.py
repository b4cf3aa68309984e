"""The operators' view: an MLflow run per process over time, and acceptance-drift detection."""

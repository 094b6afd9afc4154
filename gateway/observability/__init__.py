"""Observability: each request's outcome observed exactly once (``observe``), Prometheus
metrics, per-user throughput stats and the persisted request records."""

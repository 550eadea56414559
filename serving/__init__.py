"""serving: what every kvserve gRPC server shares and that is not the store.

`errors` (the ServiceError family and the one exception -> status mapping), `server` (start, health,
reflection, the error interceptor, graceful stop), `metrics` (request outcome and latency helpers),
`cli` (the flags every service takes, size parsing), `cache_session` (the store as a best-effort
cache) and `requests` (the request contract that decode and prefill share).
"""

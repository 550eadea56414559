"""serving: what every kvserve gRPC server shares and that is not the store.

`errors` (the ServiceError family and the one exception -> status mapping), `server` (start, health,
reflection, the error interceptor, graceful stop), `metrics` (request outcome and latency helpers),
`cli` (the flags every service takes, size parsing), `cache_session` (the store as a best-effort
cache), `requests` (the request contract that decode and prefill share), `auth` (bearer tokens and
tenants at the front door, `kvserve token`), `tls` (TLS settings, credentials and channels) and
`certs` (`kvserve certs`: a local CA and service certificates).
"""

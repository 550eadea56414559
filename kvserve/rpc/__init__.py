"""rpc: the plumbing every kvserve gRPC server shares, the bottom layer (it imports no store and no engine).

`errors` (the ServiceError family and the one exception -> status mapping), `server` (start, health,
reflection, the error interceptor, graceful stop), `metrics` (request outcome and latency helpers),
`cli` (the flags every service takes, size parsing), `addresses` (targets that resolve to several
replicas), `auth` (bearer tokens and tenants at the front door, `kvserve token`), `tls` (TLS settings,
credentials and channels) and `certs` (`kvserve certs`: a local CA and service certificates).
"""

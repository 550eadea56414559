"""kvserve: disaggregated prefill and decode over gRPC with a tiered, prefix-keyed KV-cache store.

The design card's packages stay at the top (protos, kvstore, prefill_service, decode_service, client);
the rest of the system lives here. Importing this package imports nothing else.
"""

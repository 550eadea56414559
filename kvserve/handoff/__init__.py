"""handoff: how a prompt's KV travels from prefill's pool to decode's, through the KV store.

`requests` (what decode asks of prefill, and the handle prefill answers with), `prefill_kv` and
`decode_kv` (each service's side: the engine's KVSource over the store), `session` (the store as a
best-effort cache), `codec` (the block format: header, checksum, verification) and `transfer`
(blocks between pool slots and the store, one copy each way).
"""

"""`kvserve router`: the Decode API in front of several decode replicas, placing each request where
its prefix's KV already is. index: which blocks each replica holds; replica: one replica's health, load and
events; policy: which replica a request goes to, and ejection; router: placing and relaying a request's
stream; server: the Decode servicer and metrics."""

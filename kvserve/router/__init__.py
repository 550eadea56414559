"""`kvserve router`: the Decode API in front of several decode replicas, placing each request where
its prefix's KV already is (router.router)."""

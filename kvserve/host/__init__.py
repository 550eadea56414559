"""host: what a service sets up in its own process and shares with the others on its host, below the gRPC
plumbing (standard library only; torch is set up through what the process has already loaded).

`process` (the engine process's set-up: thread budget, malloc, oneDNN's caches, the GIL; dying with its
parent), `priority` (the threads that take calls above the engine's), `collector` (Python's full collections
off the path of calls), `memory` (the memory a cache takes by default) and `cores` (idle cores lent between
the compute services of one host).
"""

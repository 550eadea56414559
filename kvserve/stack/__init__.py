"""stack: the local stack (the three services as processes on one machine) and `kvserve up`'s supervisor."""

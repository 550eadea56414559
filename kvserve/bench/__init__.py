"""bench: every `kvserve bench NAME`, each against a baseline measured in the same run, and its peers'
baselines (Hugging Face `generate`, in-process reuse, memcpy)."""

"""Pytrees in our namespace, the call key, call forms, and the KV-cache adapter."""

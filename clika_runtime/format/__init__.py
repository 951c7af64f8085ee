"""A graph file read as untrusted bytes, its declared interface, the metadata schema, and tree descriptions."""

"""A graph file read as untrusted bytes, the metadata schema, and tree descriptions."""

"""Writing converted models: atomic folders and the native (trust_remote_code) format."""

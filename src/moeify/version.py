"""moeify's version, importable from every layer without importing the API."""

__version__ = "0.1.0"

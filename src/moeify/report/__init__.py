"""Reports built from ``record.json`` files only (never by calling into conversions)."""

"""Perplexity, speed and the JSON record every command writes."""

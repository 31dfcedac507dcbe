"""Corpora for the drafters: the .esc file format, building and merging, presets."""

"""Leaf helpers every layer may use and that use no other shardc package: the report
tables (text, rich, HTML) and simulated CPU devices."""

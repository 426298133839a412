"""Leaf helpers every layer may use and that use no other shardc package: the report
tables (text, rich, HTML), simulated CPU devices and mesh axis names as specs write them."""

"""The decoding rules, one implementation per backend: the Python reference (python.py) and the same rules in C
(native.py, _rows.c). jfcore/decoding/decoder.py picks which runs."""

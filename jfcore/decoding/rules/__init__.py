"""The decoding rules, one implementation per backend: the Python reference (python.py) and the same rules in C
(native.py, _step.c). jfcore/decoding/decoder.py picks which runs."""

"""The command-line entry points: jf-decode (decode.py), jf-serve (serve.py), jf-tune (tune.py), jf-train
(train.py) and jf-eval (evaluate.py). Each parses its arguments, runs a stage or the library, and turns bad input
into one line saying what to fix."""

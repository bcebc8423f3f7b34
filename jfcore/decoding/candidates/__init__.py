"""Draft candidates verified beside a row's own draft: prompt lookup and the rejection-recycling n-gram pool (the
Python references; the C rules use the same in C, jfcore/decoding/rules/_lookup.c and _ngram.c)."""
